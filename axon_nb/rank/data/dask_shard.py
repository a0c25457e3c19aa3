"""A dask collection as training data: equal pieces, each data-parallel rank holding its own.

The collection's rows (partitions in order) are cut into ``P`` equal pieces of ``m`` rows
(``P`` = its number of partitions; the last ``N mod P`` rows are left out), so uneven
partitions are rebalanced. Piece ``k`` belongs to data-parallel rank ``k mod W``. An epoch's
order deals the pieces out round-robin, each piece shuffled on its own from the seed and
epoch: global position ``p`` is row ``tau[p // P]`` of piece ``p mod P``. That order does not
depend on ``W``, and position ``p`` lands on rank ``p mod W``, which owns piece ``p mod P``
(``W`` divides ``P``): each rank reads only its own pieces, and one process (``W = 1``)
trains on exactly the same global batches.

Example::

    x, y = assemble(parts, pieces_of(rank=0, replicas=2, lengths=[100, 90, 110, 100]))
    # (axon_nb.spec.dask_rows)
    dataset = PiecesDataset(x, y, pieces=4, piece_rows=100, data_rank=0, replicas=2)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import TensorDataset


class PiecesDataset(TensorDataset):
    """One data-parallel rank's pieces as tensors, with the sampler that deals them out."""

    def __init__(
        self,
        inputs: np.ndarray,
        targets: np.ndarray,
        *,
        pieces: int,
        piece_rows: int,
        data_rank: int,
        replicas: int,
    ) -> None:
        super().__init__(torch.from_numpy(inputs), torch.from_numpy(targets))
        self.pieces, self.piece_rows = pieces, piece_rows
        self.data_rank, self.replicas = data_rank, replicas

    def sampler(self, seed: int) -> PieceOrder:
        return PieceOrder(self.pieces, self.piece_rows, self.data_rank, self.replicas, seed)


class PieceOrder:
    """This rank's share of an epoch's order, as indices into its :class:`PiecesDataset`
    (the interface of ``DistributedSampler``: ``set_epoch``, ``len``, iteration)."""

    def __init__(self, pieces: int, rows: int, rank: int, replicas: int, seed: int) -> None:
        self.pieces, self.rows, self.rank, self.replicas, self.seed = (
            pieces, rows, rank, replicas, seed,
        )  # fmt: skip
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.pieces * self.rows // self.replicas

    def __iter__(self) -> Iterator[int]:
        shuffles = {}
        for k in range(self.rank, self.pieces, self.replicas):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + k)
            shuffles[k] = torch.randperm(self.rows, generator=g).tolist()
        for p in range(self.rank, self.pieces * self.rows, self.replicas):
            piece, row = p % self.pieces, p // self.pieces
            yield (piece // self.replicas) * self.rows + shuffles[piece][row]
