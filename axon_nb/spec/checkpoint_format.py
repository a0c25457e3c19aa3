"""Checkpoints on disk: their layout, the completeness marker, and reading what one holds.

A checkpoint is a directory::

    path/
      axon_checkpoint.json    what it holds (see Checkpoint); written last
      state.pt                kind "full": gathered model and optimizer state, written by rank 0
      .metadata, *.distcp     kind "sharded": torch.distributed.checkpoint, each rank its shards

How a save keeps ``path`` safe at every instant:

- The kernel creates ``path.partial-<id>`` (owner-only unless ``private=False``); the ranks
  write into it; rank 0 writes the marker once every rank has finished, so a directory without
  one is never taken for complete. A failed save's partial directory is removed.
- Rank 0 then moves it to ``path``, claiming ``path`` first (``mkdir``, which fails if anything
  is there), so nothing someone else created at ``path`` meanwhile is replaced or deleted: the
  save fails instead, and says where its complete checkpoint is.
- Replacing a checkpoint (``overwrite=True``) renames the old one to ``path.old-<id>``, moves
  the new one in and then deletes the old one. If the process dies between the two renames,
  :meth:`Checkpoint.read` finds the complete checkpoint beside ``path`` and reads that one.

Plain Python (no torch): the kernel checks and reads checkpoints with it, the ranks write
the marker with it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

MARKER = "axon_checkpoint.json"
FORMAT = "axon_nb.checkpoint/1"
KINDS = ("full", "sharded")
FULL_STATE_FILE = "state.pt"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


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
        """Read the checkpoint at ``path``; raises a clear error if it is missing or incomplete.

        If nothing is at ``path`` because a save replacing it died between its two renames,
        the most recently completed checkpoint beside it (``path.partial-*`` or
        ``path.old-*`` with a marker) is read instead, with a warning naming it; its ``.path``
        says which one it is. Example::

            Checkpoint.read("ckpt/step100").step
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.lexists(path) or _is_empty_dir(path):  # an empty one: a save's claim
            beside = complete_beside(path)
            if beside is not None:
                warnings.warn(
                    f"nothing is at {path}: a save replacing it stopped before moving its "
                    f"checkpoint in. Reading the complete checkpoint beside it, {beside}; "
                    f"rename that directory to {path} to make it the checkpoint there again",
                    stacklevel=2,
                )
                return cls._read_complete(beside)
        if not os.path.isdir(path):
            partial = partial_writes(path)
            if partial:
                raise FileNotFoundError(
                    f"the checkpoint {path} was never completed: its write was interrupted "
                    f"(its parts are in {partial[0]}). Nothing was loaded; save it again, or "
                    "load an earlier checkpoint"
                )
            raise FileNotFoundError(f"no checkpoint at {path}")
        return cls._read_complete(path)

    @classmethod
    def _read_complete(cls, path: str) -> Checkpoint:
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

    def write_marker(self, directory: str, private: bool = True) -> None:
        """Write this checkpoint's marker into ``directory`` (owner-only if ``private``) and
        flush it to disk."""
        meta = {"format": FORMAT, **{k: v for k, v in asdict(self).items() if k != "path"}}
        target = os.path.join(directory, MARKER)
        mode = PRIVATE_FILE_MODE if private else 0o666
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            if private:
                os.fchmod(f.fileno(), PRIVATE_FILE_MODE)
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


@dataclass(frozen=True)
class SaveTarget:
    """Where one save writes, as the kernel planned it; sent to every rank.

    Example::

        target = plan_save("ckpt/step100", "sharded", overwrite=False)
        target.partial  # '/abs/ckpt/step100.partial-3f2a...'
    """

    path: str
    """Where the complete checkpoint goes (absolute)."""
    partial: str
    """The directory the ranks write into; the kernel creates it and removes it on failure."""
    kind: str
    replaces: str | None
    """:func:`fingerprint` of the checkpoint at ``path`` when the save was checked (None if
    nothing was there): only that checkpoint may be replaced."""
    private: bool = True
    """Create directories 0o700 and files 0o600 (else as the umask says)."""

    def create_partial(self) -> None:
        """Create the (empty) partial directory, owner-only if ``private``."""
        os.mkdir(self.partial, PRIVATE_DIR_MODE if self.private else 0o777)
        if self.private:
            os.chmod(self.partial, PRIVATE_DIR_MODE)  # whatever the umask

    def discard_partial(self) -> bool:
        """Remove the partial directory of a failed save unless it holds a complete
        checkpoint (then a rank's error says where it is); True if it was removed."""
        if os.path.isfile(os.path.join(self.partial, MARKER)):
            return False
        shutil.rmtree(self.partial, ignore_errors=True)
        return not os.path.lexists(self.partial)


def fingerprint(path: str) -> str | None:
    """A digest of the marker of the checkpoint at ``path``, or None if it has none."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def partial_writes(path: str) -> list[str]:
    """Directories left by interrupted writes of the checkpoint at ``path`` (no marker)."""
    found = glob.glob(glob.escape(path) + ".partial-*")
    return sorted(d for d in found if not os.path.isfile(os.path.join(d, MARKER)))


def complete_beside(path: str) -> str | None:
    """The most recently completed checkpoint beside ``path`` that a save left there when it
    stopped before moving it in (``path.partial-*``) or after moving the old one aside
    (``path.old-*``); None if there is none."""
    found = glob.glob(glob.escape(path) + ".partial-*") + glob.glob(glob.escape(path) + ".old-*")
    complete = [d for d in found if os.path.isfile(os.path.join(d, MARKER))]
    return max(complete, key=lambda d: os.stat(os.path.join(d, MARKER)).st_mtime_ns, default=None)


def _is_empty_dir(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.listdir(path)
    except OSError:
        return False


def plan_save(
    path: str | os.PathLike[str], kind: str, overwrite: bool, private: bool = True
) -> SaveTarget:
    """Check a save's ``kind`` and what is at ``path``, and name its partial directory.

    Example::

        plan_save("ckpt/step100", "full", overwrite=True).replaces  # the old one's digest
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be 'full' or 'sharded', got {kind!r}")
    path = os.path.abspath(os.fspath(path))
    replaces = None
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(
                f"{path} already exists; pass overwrite=True to replace it (the old checkpoint "
                "stays in place until the new one is complete), or choose another path"
            )
        replaces = fingerprint(path)
        if replaces is None:
            raise FileExistsError(
                f"{path} exists and is not an axon_nb checkpoint; it will not be replaced. "
                "Choose another path"
            )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    return SaveTarget(path=path, partial=partial, kind=kind, replaces=replaces, private=private)
