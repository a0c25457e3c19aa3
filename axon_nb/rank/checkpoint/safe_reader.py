"""Reading sharded checkpoints without running code from them.

``torch.distributed.checkpoint`` unpickles a checkpoint's ``.metadata`` and its non-tensor
entries (``param_groups`` values such as ``lr`` or ``betas``) with plain ``pickle``: a planted
file would run code on every rank. :class:`SafeReader` reads the same files, but

- ``.metadata`` with an unpickler that constructs only what DCP metadata holds (its dataclasses,
  ``torch.Size``, dtypes, layouts, paths) and refuses every other global;
- every non-tensor entry with ``torch.load(weights_only=True)``, accepting only plain values
  (None, bools, numbers, strings, lists, tuples, dicts, tensors), before the planner sees it;
- only data files inside the checkpoint directory.

Example::

    reader = SafeReader("ckpt/step100")
    reader.check()  # raises UnsafeCheckpointError before anything is loaded
    dcp.load(state, storage_reader=reader)
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles
    "torch": frozenset({"Size"}),  # and every dtype, by name (see _find_class)
    "pathlib": frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}
"""The globals a DCP ``.metadata`` may name (torch 2.x); everything else is refused."""

PLAIN_TYPES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, torch.Tensor)
"""Leaf types a non-tensor checkpoint entry may hold (inside lists, tuples and dicts)."""

_WHAT_TO_DO = "Load only checkpoints you trust; if this one is yours, save it again from its run"


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something that loading it would have to execute; nothing was loaded."""


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that never unpickles anything but plain checkpoint data.

    Example::

        dcp.load(state, storage_reader=SafeReader(path))
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled through :data:`ALLOWED_GLOBALS` only."""
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = os.path.join(self.path, name)
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, name).load_metadata()
        storage_meta = getattr(metadata, "storage_meta", None)  # (older files have none)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As ``FileSystemReader``, refusing data files outside the checkpoint directory."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for index, info in self.storage_data.items():
            relative = getattr(info, "relative_path", None)
            if (
                not isinstance(relative, str)
                or not relative
                or os.path.basename(relative) != relative
                or relative in (".", "..")
            ):
                raise UnsafeCheckpointError(
                    f"the checkpoint's {METADATA_FILE} places {getattr(index, 'fqn', index)!r} "
                    f"in {relative!r}, outside the checkpoint directory; it was not loaded (it "
                    f"may have been tampered with). {_WHAT_TO_DO}"
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """As ``FileSystemReader``, but the non-tensor entries are read first, as plain values
        only, so a refused one leaves every tensor of the state untouched."""
        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        collect = _Collect()
        if byte_items:
            super().read_data(LoadPlan(byte_items), collect)
        for item in byte_items:
            planner.load_bytes(item, _reserialized(collect.values[item.dest_index.fqn]))
        tensor_items = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        return super().read_data(
            LoadPlan(tensor_items, plan.storage_data, plan.planner_data), planner
        )

    def check(self) -> Metadata:
        """Read the metadata and every non-tensor entry safely, loading nothing; raises
        :class:`UnsafeCheckpointError` (or ``FileNotFoundError``) on what ``dcp.load`` must
        not read. Example::

            SafeReader("ckpt/step100").check().state_dict_metadata.keys()
        """
        metadata = self.read_metadata()
        self.set_up_storage_reader(metadata, is_coordinator=False)
        items = [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(fqn),
                dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(fqn),
                storage_offsets=torch.Size((0,)),
                lengths=torch.Size((0,)),
            )
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, BytesStorageMetadata)
        ]
        if items:
            super().read_data(LoadPlan(items), _Collect())
        self.storage_data = {}
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the checkpoint's {self.name} references {module}.{name}, which a checkpoint never "
            f"needs; it was not loaded (it may have been tampered with). {_WHAT_TO_DO}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"the checkpoint's {self.name} holds a persistent reference, which DCP metadata "
            f"never has; it was not loaded (it may have been tampered with). {_WHAT_TO_DO}"
        )

    def load_metadata(self) -> Metadata:
        try:
            metadata = self.load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:
            raise UnsafeCheckpointError(
                f"the checkpoint's {self.name} could not be read ({type(e).__name__}: {e}); it "
                "is damaged or not a torch.distributed.checkpoint. Nothing was loaded; load "
                "an earlier checkpoint or save this one again"
            ) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"the checkpoint's {self.name} holds a {type(metadata).__name__}, not DCP "
                f"metadata; it was not loaded (it may have been tampered with). {_WHAT_TO_DO}"
            )
        return metadata


class _Collect(DefaultLoadPlanner):
    """The planner side of reading non-tensor entries: loads each as plain values only (the
    reader asks it for nothing else)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = (
                f"references {refused.group(1)}, which a checkpoint never needs"
                if refused
                else f"is not plain data ({_first_line(e)})"
            )
            raise UnsafeCheckpointError(
                f"the checkpoint's entry {fqn!r} {what}; it was not loaded (it may have been "
                f"tampered with). {_WHAT_TO_DO}"
            ) from None
        odd = _not_plain(obj)
        if odd is not None:
            raise UnsafeCheckpointError(
                f"the checkpoint's entry {fqn!r} holds a {odd}, where a checkpoint holds only "
                f"numbers, strings, lists, dicts and tensors; it was not loaded. {_WHAT_TO_DO}"
            )
        self.values[fqn] = obj


def _not_plain(obj: Any, depth: int = 0) -> str | None:
    """The type name of the first value in ``obj`` that is not plain data, or None."""
    if depth > 32:
        return "structure nested deeper than 32 levels"
    if isinstance(obj, list | tuple):
        return next((t for v in obj if (t := _not_plain(v, depth + 1))), None)
    if isinstance(obj, dict):
        return next((t for kv in obj.items() for v in kv if (t := _not_plain(v, depth + 1))), None)
    if isinstance(obj, PLAIN_TYPES):
        return None
    return type(obj).__qualname__


def _reserialized(obj: Any) -> io.BytesIO:
    """``obj`` (checked plain data) as fresh bytes, so the planner unpickles nothing it read."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
