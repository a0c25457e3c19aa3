"""Iterable and streaming data: each rank reads its own items, steps stay aligned.

Item ``i`` of the stream belongs to data-parallel rank ``i mod W``; a rank groups its items
into micro-batches, and loader worker ``w`` of ``K`` reads the rank's batches ``w, w + K,
...``. The DataLoader takes batches from its workers in turn, so a rank sees the same batches
in the same order for any number of workers, and step ``s`` across all ranks is items
``s*B .. (s+1)*B`` of the stream: what one process with batch ``B`` trains on.

Before each step the ranks agree (one all-reduce on a CPU group, so a GPU never waits for
it) that every one of them has a whole step's batches; when one has run out, all stop at the
same step. The position in the stream is the step count times the batches a step takes, so a
resumed run (``resume=True``, or a restart from a checkpoint, which records the step) skips
exactly what was read; the stream must give the same items when read again.

Example::

    cluster.train(model=..., data=MyStream(), batch_size=64, steps=10_000,
                  loader=dict(num_workers=2))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from axon_nb.rank.data.prefetch import prefetched
from axon_nb.rank.data.shards import loader_options


def is_iterable(data: Any) -> bool:
    """An ``IterableDataset``, or an object that can only be iterated (no ``__getitem__``)."""
    return isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
    )


class RankItems(IterableDataset):
    """The batches of one data-parallel rank from ``source``, for one loader worker each,
    starting after the rank's first ``skip`` micro-batches."""

    def __init__(self, source: Any, rank: int, replicas: int, micro_batch: int, skip: int) -> None:
        self.source, self.rank, self.replicas = source, rank, replicas
        self.micro_batch, self.skip = micro_batch, skip

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for i, item in enumerate(self.source):
            if i % self.replicas != self.rank:
                continue
            batch = (i // self.replicas) // self.micro_batch - self.skip
            if batch >= 0 and batch % workers == worker:
                yield item


class IterableSteps:
    """``StepBatches`` for iterable data: each step's micro-batches, until any rank runs out."""

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        device: torch.device,
        loader: dict[str, Any] | None = None,
    ) -> None:
        self.source, self.rank, self.replicas = source, rank, world_size
        self.micro_batch = batch_size // (world_size * grad_accum)
        self.grad_accum = grad_accum
        self.device = device
        self.loader_options = loader_options(loader, device)
        self.ended_at: int | None = None
        """The step at which the data ran out on some rank (None while it lasts)."""

    def on_device(self, step: int) -> Iterator[list[Any]]:
        return prefetched(self.from_step(step), self.device)

    def from_step(self, step: int) -> Iterator[list[Any]]:
        items = RankItems(
            self.source, self.rank, self.replicas, self.micro_batch, step * self.grad_accum
        )
        loader = DataLoader(
            items, batch_size=self.micro_batch, drop_last=True, **self.loader_options
        )
        batches = iter(loader)
        while True:
            step_batches = [b for _, b in zip(range(self.grad_accum), batches, strict=False)]
            if not self._everyone_has(len(step_batches) == self.grad_accum):
                self.ended_at = step
                return
            yield step_batches
            step += 1

    def _everyone_has(self, mine: bool) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        flag = torch.tensor([float(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_host_group())
        return bool(flag.item())


_HOST_GROUP: tuple[Any, Any] | None = None


def _host_group() -> Any:
    """A gloo group of every rank (host memory: agreeing on it never waits for a GPU), made
    once per world, on first use: by then every rank has set up the run."""
    global _HOST_GROUP
    world = dist.group.WORLD
    if _HOST_GROUP is None or _HOST_GROUP[0] is not world:
        _HOST_GROUP = (world, dist.new_group(backend="gloo"))
    return _HOST_GROUP[1]
