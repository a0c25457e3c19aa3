"""Notebook datasets on the ranks: their large tensors held once per host, kept across calls.

The kernel (``axon_nb.train.notebook_data``) drives four steps, each a call in ``entry.py``:

1. one rank per host receives each missing tensor's bytes, in messages of a few tens of MB,
   and writes them to a new owner-only file under ``/dev/shm`` (:func:`write`);
2. every rank of that host maps the file (:func:`map_files`): one copy in memory, whatever
   the number of ranks;
3. the writing rank unlinks the file (:func:`unlink`): nothing stays in ``/dev/shm``, and the
   memory is freed when the last rank lets go of its mapping (the entry is dropped, or the
   engine ends);
4. each ``train`` call sends the dataset's skeleton, which :func:`rebuild` unpickles around
   the tensors held here, by key (:func:`held` first says which keys are still here).

The ranks of a host share the copy: code on a rank that writes into it writes for all of
them. A tensor written in place on a rank is dropped at the next :func:`held`, so the kernel
sends it again.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from typing import Any, cast

import torch

from axon_nb.rank import runtime
from axon_nb.spec.shared_data import SharedData, SharedTensor, file_name, shm_dirs


@dataclass(slots=True)
class _Held:
    tensor: torch.Tensor
    version: int
    """The tensor's version counter when mapped: another value means it was written here."""


_held: dict[str, _Held] = {}
_writing: dict[str, tuple[str, int]] = {}
"""Key -> (path, open file descriptor) of copies this rank is writing."""
_files: dict[str, str] = {}
"""Key -> path of files this rank created and has not removed yet."""


def write(pieces: list[tuple[str, int, int, Any]]) -> dict[str, str]:
    """Write each piece ``(key, nbytes, offset, chunk)``: ``chunk`` (a buffer) at ``offset`` of
    ``key``'s copy of ``nbytes`` bytes, whose file is created by its first piece; the paths of
    the files created, by key."""
    created = {}
    for key, nbytes, offset, chunk in pieces:
        if key not in _writing:
            created[key] = _create(key, nbytes)
        fd = _writing[key][1]
        view = memoryview(chunk).cast("B")
        done = 0
        while done < len(view):  # a write may take less than it was given
            done += os.pwrite(fd, view[done:], offset + done)
        if offset + len(view) >= nbytes:
            del _writing[key]
            os.close(fd)
    return created


def _create(key: str, nbytes: int) -> str:
    dirs = shm_dirs()
    room = [d for d in dirs if shutil.disk_usage(d).free >= nbytes]
    if not room:
        free = ", ".join(f"{d}: {shutil.disk_usage(d).free / 2**20:.0f} MiB" for d in dirs)
        raise OSError(
            f"a tensor of the dataset needs {nbytes / 2**20:.0f} MiB and no shared-memory "
            f"directory has room ({free}): enlarge /dev/shm (docker run --shm-size=...), or "
            "pass a callable that builds the data on the ranks (data=make_dataset)"
        )
    path = os.path.join(room[0], file_name(os.getpid(), key))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # owner-only, never reused
    _writing[key] = (path, fd)
    _files[key] = path
    return path


def map_files(copies: dict[str, list[tuple[SharedTensor, str]]]) -> None:
    """Map each copy ``(tensor, path)`` written on this rank's host (``copies`` by host) and
    hold it under its key (replacing what the key held)."""
    for meta, path in copies.get(runtime.context().host, []):
        dtype = getattr(torch, meta.dtype)
        nbytes = meta.numel * dtype.itemsize
        # (torch's stubs type from_file's result as any storage, and want set_'s strides)
        storage = cast(
            torch.UntypedStorage, torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        )
        shape = meta.shape
        row_major = tuple(math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape, row_major)
        _held[meta.key] = _Held(tensor, tensor._version)


def unlink(keys: list[str]) -> None:
    """Remove the files of ``keys`` this rank wrote (mapped copies live on), finished or not."""
    for key in keys:
        if key in _writing:
            os.close(_writing.pop(key)[1])
        path = _files.pop(key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def held(keys: list[str], drop: list[str]) -> list[str]:
    """Drop ``drop`` (and any tensor written in place on this rank), then say which of
    ``keys`` this rank holds."""
    for key in drop:
        _held.pop(key, None)
    for key, entry in list(_held.items()):
        if entry.tensor._version != entry.version:
            del _held[key]
    return [key for key in keys if key in _held]


def held_bytes() -> dict[str, int]:
    """Bytes of each tensor held, by key (what ``%axon_status`` and the tests read)."""
    return {k: e.tensor.numel() * e.tensor.element_size() for k, e in _held.items()}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: SharedData) -> None:
        super().__init__(io.BytesIO(data.skeleton))
        self._tensors = data.tensors
        self._views = data.views

    def persistent_load(self, pid: Any) -> Any:
        if not self._views:
            return self._copy(self._tensors[pid])
        view = self._views[pid]
        held = self._copy(self._tensors[view.tensor])
        made = held.as_strided(view.shape, view.stride, view.offset)  # (shares the held copy)
        return made.numpy() if view.numpy else made

    def _copy(self, meta: SharedTensor) -> torch.Tensor:
        """This host's copy of ``meta``."""
        entry = _held.get(meta.key)
        if entry is None:  # the kernel checks with held() before each run
            raise RuntimeError(
                f"the dataset's tensor {meta.key} is not held on this rank; call train again "
                "to send it"
            )
        return entry.tensor


def rebuild(data: SharedData) -> Any:
    """The notebook's dataset, its large tensors being this host's shared copies."""
    return _Unpickler(data).load()
