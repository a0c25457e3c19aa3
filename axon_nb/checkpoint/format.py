"""Checkpoints on disk: their layout, the completeness marker, and reading what one holds.

A checkpoint is a directory::

    path/
      axon_checkpoint.json    what it holds (see Checkpoint); written last
      state.pt                kind "full": gathered model and optimizer state, written by rank 0
      .metadata, *.distcp     kind "sharded": torch.distributed.checkpoint, each rank its shards

It is written into ``path.partial-<id>`` and renamed to ``path`` by rank 0 only once every rank
has written its part and the marker is on disk. An interrupted write therefore leaves a
``.partial-`` directory and never a ``path`` that looks complete; replacing a checkpoint
(``overwrite=True``) keeps the old one until the new one is complete.

Plain Python (no torch): the kernel checks and reads checkpoints with it, the ranks write
the marker with it.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

MARKER = "axon_checkpoint.json"
FORMAT = "axon_nb.checkpoint/1"
KINDS = ("full", "sharded")
FULL_STATE_FILE = "state.pt"


@dataclass(frozen=True)
class Checkpoint:
    """What a complete checkpoint holds, as its marker file says.

    Example::

        ckpt = axon_nb.Checkpoint.read("ckpt/step100")
        ckpt.step, ckpt.kind, ckpt.world_size
    """

    path: str
    kind: str
    """``"full"`` or ``"sharded"``."""
    name: str
    """The training run it was saved from."""
    step: int
    """Optimizer steps taken when it was saved."""
    world_size: int
    strategy: str
    optimizer: str
    """Class name of the optimizer (``AdamW``, ...)."""
    model: dict[str, list[int]] = field(repr=False)
    """Shape of every entry of the model's state dict, by name."""
    trainer: dict[str, Any] = field(repr=False)
    """Scheduler and grad-scaler state, and whether the optimizer had state yet."""

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Read the checkpoint at ``path``; raises a clear error if it is missing or incomplete."""
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            partial = partial_writes(path)
            if partial:
                raise FileNotFoundError(
                    f"the checkpoint {path} was never completed: its write was interrupted "
                    f"(its parts are in {partial[0]}). Nothing was loaded; save it again, or "
                    "load an earlier checkpoint"
                )
            raise FileNotFoundError(f"no checkpoint at {path}")
        marker = os.path.join(path, MARKER)
        if not os.path.isfile(marker):
            raise ValueError(
                f"{path} is not a complete axon_nb checkpoint: it has no {MARKER} (written "
                "last, when every rank has finished). Nothing was loaded"
            )
        with open(marker) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path} holds checkpoint format {meta.get('format')!r}; this axon_nb reads "
                f"{FORMAT!r}"
            )
        fields = {k: v for k, v in meta.items() if k != "format"}
        return cls(path=path, **fields)

    def write_marker(self, directory: str) -> None:
        """Write this checkpoint's marker into ``directory`` and flush it to disk."""
        meta = {"format": FORMAT, **{k: v for k, v in asdict(self).items() if k != "path"}}
        target = os.path.join(directory, MARKER)
        with open(target, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def partial_writes(path: str) -> list[str]:
    """Directories left by interrupted writes of the checkpoint at ``path``."""
    return sorted(glob.glob(glob.escape(path) + ".partial-*"))


def check_save_target(path: str | os.PathLike[str], kind: str, overwrite: bool) -> str:
    """The absolute target path of a save, after checking ``kind`` and an existing ``path``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be 'full' or 'sharded', got {kind!r}")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"{path} already exists; pass overwrite=True to replace it (the old checkpoint "
            "stays in place until the new one is complete), or choose another path"
        )
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, MARKER)):
        raise FileExistsError(
            f"{path} exists and is not an axon_nb checkpoint; it will not be replaced"
        )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path
