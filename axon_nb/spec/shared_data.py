"""What the ranks receive for a dataset built in the notebook, torch-free: the dataset pickled
without its large tensors (``SharedData``), each tensor named by a key the ranks of a host
hold in one shared-memory copy (``SharedTensor``), and where those copies are written.

The kernel makes it (``axon_nb.train.notebook_data``); the ranks rebuild the dataset from it
(``axon_nb.rank.data.shared_tensors``). A copy is written to a file under ``/dev/shm`` (or the
temporary directory when that lacks room), mapped by every rank of the host and unlinked at
once, so the memory lives exactly as long as some rank maps it. The file's name carries the
writing engine's pid, so its parent (``rank/world/launch.py``) removes what an interrupted
transfer left behind when the engine ends. Example::

    SharedData(skeleton=b"...", tensors=(SharedTensor("3f2a...", "float32", (50000, 1024)),))
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass

FILE_PREFIX = "axon_nb-data-"
"""Every shared copy's file name starts with this, then the writing engine's pid."""


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """One tensor of a notebook dataset, held once per host under ``key``."""

    key: str
    """Unique to this tensor's content (the kernel makes a new key when the content changes)."""
    dtype: str
    """The torch dtype's name without ``torch.``, e.g. ``"float32"``."""
    shape: tuple[int, ...]
    """Its shape; the copy is contiguous (row-major) whatever the original's strides."""

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True, slots=True)
class SharedView:
    """How the dataset's array ``i`` is made from a held tensor (a span of the notebook's
    storage): ``held.as_strided(shape, stride, offset)``, a NumPy array when ``numpy``."""

    tensor: int
    """Index of the held tensor in ``SharedData.tensors``."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Elements from the start of the held tensor."""
    numpy: bool = False


@dataclass(frozen=True)
class SharedData:
    """A notebook dataset as the ranks receive it: ``skeleton`` is the dataset pickled with
    cloudpickle, where persistent id ``i`` stands for ``views[i]`` (for ``tensors[i]``
    whole when there are no views)."""

    skeleton: bytes
    tensors: tuple[SharedTensor, ...]
    views: tuple[SharedView, ...] = ()

    def __repr__(self) -> str:
        return f"SharedData({len(self.skeleton)} bytes, tensors={[t.key for t in self.tensors]})"


def shm_dirs() -> list[str]:
    """Where shared copies may be written, preferred first: ``/dev/shm`` (memory), then the
    temporary directory (its page cache is shared the same way)."""
    dirs = ["/dev/shm"] if os.path.isdir("/dev/shm") else []
    return [*dirs, tempfile.gettempdir()]


def file_name(pid: int, key: str) -> str:
    """The file name of ``key``'s copy written by engine ``pid``."""
    return f"{FILE_PREFIX}{pid}-{key}"


def leftovers(pid: int | None = None) -> list[str]:
    """Shared-copy files still present (of engine ``pid``, or of any engine). Each is unlinked
    once mapped, so any found belonged to a transfer that was cut short."""
    pattern = file_name(pid, "*") if pid is not None else f"{FILE_PREFIX}*"
    return sorted(p for d in shm_dirs() for p in glob.glob(os.path.join(d, pattern)))
