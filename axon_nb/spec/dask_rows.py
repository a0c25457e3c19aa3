"""The rows side of dask data, torch-free (the kernel builds its plan with it): cutting a
collection's rows into equal pieces, assembling a rank's pieces from partitions, one
partition as arrays, and ``DaskShards``, what the ranks receive. The order the pieces are read
in is ``axon_nb.rank.data.dask_shard``'s.

Example::

    pieces_of(rank=1, replicas=2, lengths=[60, 40, 53, 50])
    # [[Slice(0, 50, 60), Slice(1, 0, 40)], [Slice(2, 50, 53), Slice(3, 0, 47)]]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def is_dask_data(data: Any) -> bool:
    """A dask collection, or a pair of dask arrays ``(inputs, targets)``. Never imports dask:
    nothing made a collection without importing it first."""
    if "dask" not in sys.modules:
        return False
    import dask

    if isinstance(data, tuple) and len(data) == 2:
        return all(dask.is_dask_collection(d) for d in data)
    return bool(dask.is_dask_collection(data))


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows ``start .. stop`` of partition ``part``."""

    part: int
    start: int
    stop: int


@dataclass(frozen=True)
class DaskShards:
    """What the ranks receive instead of a dask collection: where their rows are
    (``axon_nb.train.dask_data.place`` makes it)."""

    keys: dict[int, Any]
    """Rank -> the key of its ``(inputs, targets)`` in its own worker's memory."""
    pieces: int
    piece_rows: int
    replicas: int
    data_ranks: dict[int, int]
    """Rank -> its data-parallel index."""


def pieces_of(rank: int, replicas: int, lengths: Sequence[int]) -> list[list[Slice]]:
    """The pieces data-parallel rank ``rank`` of ``replicas`` owns, as partition slices."""
    count = len(lengths)
    rows = sum(lengths) // count
    starts = np.concatenate([[0], np.cumsum(lengths)])
    owned = []
    for k in range(rank, count, replicas):
        first, last = k * rows, (k + 1) * rows
        slices = []
        for part in range(count):
            lo, hi = max(first, starts[part]), min(last, starts[part + 1])
            if lo < hi:
                slices.append(Slice(part, int(lo - starts[part]), int(hi - starts[part])))
        owned.append(slices)
    return owned


def assemble(
    parts: Sequence[tuple[np.ndarray, np.ndarray]] | dict[int, tuple[np.ndarray, np.ndarray]],
    owned: list[list[Slice]],
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows, piece after piece: ``(inputs, targets)``. ``parts[i]`` is partition
    ``i``'s ``(inputs, targets)``; only the partitions ``owned`` names are read."""
    xs = [parts[s.part][0][s.start : s.stop] for piece in owned for s in piece]
    ys = [parts[s.part][1][s.start : s.stop] for piece in owned for s in piece]
    return np.concatenate(xs), np.concatenate(ys)


def to_arrays(part: Any, columns: tuple[Any, Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """One partition as ``(inputs, targets)`` arrays: a pandas frame's ``columns`` (feature
    names, target name or names), a pair of arrays, or a list of ``(input, target)`` items.
    Float inputs become float32; integer targets int64 (class labels), float ones float32."""
    if columns is not None:
        features, target = columns
        x, y = part[list(features)].to_numpy(), part[target].to_numpy()
    elif isinstance(part, tuple):
        x, y = np.asarray(part[0]), np.asarray(part[1])
    else:
        items = list(part)
        x = np.stack([np.asarray(i[0]) for i in items]) if items else np.empty((0,))
        y = np.stack([np.asarray(i[1]) for i in items]) if items else np.empty((0,))
    return _floats(x), _targets(y)


def _floats(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.kind in "fb" or a.dtype == object else a


def _targets(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    return a.astype(np.float32)


def length(xy: tuple[np.ndarray, np.ndarray]) -> int:
    return len(xy[0])
