"""The data side of the loop: each rank's shard of the dataset, cut into steps of micro-batches."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from axon_nb.rank.data.dask_shard import PiecesDataset
from axon_nb.rank.data.prefetch import prefetched
from axon_nb.rank.data.structure import collate
from axon_nb.spec.dask_rows import DaskShards, is_dask_data
from axon_nb.spec.shared_data import SharedData


def _dask_pieces(shards: DaskShards, rank: int) -> PiecesDataset:
    """``rank``'s pieces of a dask collection, from its own dask worker's memory."""
    from axon_nb.rank.data.dask_worker import local_data

    x, y = local_data(shards.keys[rank])
    return PiecesDataset(
        x, y, pieces=shards.pieces, piece_rows=shards.piece_rows,
        data_rank=shards.data_ranks[rank], replicas=shards.replicas,
    )  # fmt: skip


def resolve_dataset(data: Any, rank: int = 0) -> Dataset[Any]:
    """``data`` itself when it is a dataset, else ``data()``; checked to be map-style. A dask
    collection comes as :class:`DaskShards`: ``rank``'s pieces, from its own worker; a dataset
    built in the notebook as :class:`SharedData`, rebuilt around this host's shared tensors."""
    if isinstance(data, DaskShards):
        return _dask_pieces(data, rank)
    if isinstance(data, SharedData):
        from axon_nb.rank.data.shared_tensors import rebuild

        data = rebuild(data)
    factory = isinstance(data, type) or not hasattr(data, "__getitem__")  # a class is one too
    dataset = data() if callable(data) and factory else data
    if is_dask_data(dataset):
        raise TypeError(
            "data= returned a dask collection on the ranks: pass the collection itself "
            "(data=df, with columns= for a DataFrame), so its partitions are laid out over "
            "the ranks' dask workers instead of computed whole on every rank"
        )
    if isinstance(dataset, IterableDataset):
        return dataset  # read as a stream (axon_nb.rank.data.iterable)
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"data must be a map-style Dataset (with __len__ and __getitem__), an "
            f"IterableDataset, or a callable returning one; got {type(dataset).__name__}"
        )
    return dataset


class StepBatches:
    """Yields, for each optimizer step, this rank's ``grad_accum`` micro-batches on ``device``.

    With ``world_size`` ranks, global step ``s`` covers positions ``s*B .. (s+1)*B`` of the
    epoch's shuffled order (``B`` = global batch), exactly as one process with batch ``B``
    would: the distributed sampler deals that order out round-robin, so the ranks' micro-batches
    together are the same samples. That is what makes DDP comparable with ``train_local``.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        loader: dict[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.loader_options = loader_options(loader, device)
        self.micro_batch = batch_size // (world_size * grad_accum)
        self.grad_accum = grad_accum
        self.device = device
        self.sampler: Any = (
            dataset.sampler(seed)  # each rank reads only its own pieces
            if isinstance(dataset, PiecesDataset)
            else DistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                drop_last=True,
            )
        )  # fmt: skip
        per_rank = self.micro_batch * grad_accum
        self.steps_per_epoch = len(self.sampler) // per_rank
        if self.steps_per_epoch == 0:
            samples = len(cast(Sized, dataset))  # (map-style: torch's Dataset type omits len)
            raise ValueError(
                f"the dataset has {samples} samples: split over {world_size} ranks each "
                f"rank's shard holds {len(self.sampler)}, fewer than the {per_rank} one step "
                f"takes per rank (batch_size={batch_size} / {world_size} ranks). Use a smaller "
                "batch_size or more data"
            )

    def on_device(self, step: int) -> Iterator[list[Any]]:
        """:meth:`from_step` with the batches on the rank's device, prefetched one step ahead
        on a GPU (``axon_nb.rank.data.prefetch``)."""
        return prefetched(self.from_step(step), self.device)

    def from_step(self, step: int) -> Iterator[list[Any]]:
        """Micro-batch lists (in host memory, pinned on a GPU rank) for global steps ``step,
        step + 1, ...``, epoch after epoch."""
        per_step = self.micro_batch * self.grad_accum
        indices = _Indices()  # one loader for the run, so persistent workers persist
        loader = DataLoader(
            self.dataset, batch_size=self.micro_batch, sampler=indices, **self.loader_options
        )
        while True:
            epoch, offset = divmod(step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            indices.order = list(self.sampler)[offset * per_step : self.steps_per_epoch * per_step]
            batches = iter(loader)
            for _ in range(self.steps_per_epoch - offset):
                yield [next(batches) for _ in range(self.grad_accum)]
                step += 1


class _Indices(Sampler[int]):
    """The current epoch's indices for this rank (set before each pass of the loader)."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def loader_options(given: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """The DataLoader keywords of a run: ``given`` (checked in the kernel by
    ``axon_nb.spec.train_spec``), with pinned memory on GPU ranks and
    :func:`~axon_nb.rank.data.structure.collate` unless it says otherwise."""
    options = dict(given or {})
    options.setdefault("pin_memory", device.type == "cuda")
    options.setdefault("collate_fn", collate)  # lists of numbers become tensors too
    return options
