"""Reading a block of a tensor stored in safetensors files straight into a tensor's memory.

The format is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte
range) and the row-major data. A block (an offset and a shape per dimension, e.g. a DTensor's
local shard) is read with ``preadv`` run by run into the destination; nothing is mapped.
``safetensors.safe_open`` maps the file instead: the pages a slice touches count in the
process's resident memory and stay mapped after the file is closed, so a rank would hold
its part twice. Example::

    files = SafetensorsFiles(["model-00001-of-00002.safetensors", ...])
    files.read_into("lm_head.weight", shard, offset=(512, 0))  # rows 512.. of the tensor
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors dtype names -> torch dtypes."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor lies in its file."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of its first element in the file."""


class SafetensorsFiles:
    """The tensors of one or more safetensors files (a sharded checkpoint), by name."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.tensors: dict[str, StoredTensor] = {}
        for path in paths:
            self.tensors.update(_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def floating_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor (what ``from_pretrained`` takes as
        the checkpoint's dtype when the config names none)."""
        return next((t.dtype for t in self.tensors.values() if t.dtype.is_floating_point), None)

    def read_into(self, name: str, out: torch.Tensor, offset: Sequence[int]) -> None:
        """Fill ``out`` with the block of tensor ``name`` that starts at ``offset`` and has
        ``out``'s shape (converted to ``out``'s dtype and device)."""
        stored = self.tensors[name]
        if out.numel() == 0:
            return
        direct = out.device.type == "cpu" and out.dtype == stored.dtype and out.is_contiguous()
        target = out if direct else torch.empty(out.shape, dtype=stored.dtype)
        view = target.reshape(-1).view(torch.uint8).numpy().data  # (a memoryview)
        item = stored.dtype.itemsize
        fd = os.open(stored.path, os.O_RDONLY)
        try:
            for at, position, size in _runs(stored.shape, tuple(out.shape), tuple(offset)):
                part = view[at * item : (at + size) * item]
                _pread_exact(fd, part, stored.start + position * item)
        finally:
            os.close(fd)
        if not direct:
            out.copy_(target)


def _header(path: str) -> dict[str, StoredTensor]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    found = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not read here")
        found[name] = StoredTensor(
            path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + info["data_offsets"][0]
        )
    return found


def _runs(
    full: tuple[int, ...], block: tuple[int, ...], offset: tuple[int, ...]
) -> Iterator[tuple[int, int, int]]:
    """``(position in the block, position in the tensor, elements)`` of each contiguous run
    of the block, in row-major order (elements, not bytes)."""
    if len(full) != len(block) or len(offset) != len(full):
        raise ValueError(f"a block of shape {block} at {offset} does not fit a tensor {full}")
    if any(o < 0 or o + b > f for f, b, o in zip(full, block, offset, strict=True)):
        raise ValueError(f"a block of shape {block} at {offset} is outside a tensor {full}")
    if not full:  # a scalar
        yield 0, 0, 1
        return
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    # runs are contiguous from the last dimension the block cuts (inclusive) to the end
    cut = max((d for d in range(len(full)) if block[d] != full[d]), default=0)
    size = math.prod(block[cut:])
    outer = itertools.product(*(range(n) for n in block[:cut]))
    for k, index in enumerate(outer):
        position = sum((offset[d] + i) * strides[d] for d, i in enumerate(index))
        yield k * size, position + offset[cut] * strides[cut], size


def _pread_exact(fd: int, buffer: memoryview, position: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], position + done)
        if got == 0:
            raise ValueError(f"the file ended {len(buffer) - done} bytes early: is it complete?")
        done += got
