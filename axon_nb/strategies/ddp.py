"""``DDP``: PyTorch's DistributedDataParallel, with its gradient compression hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class DDP(Strategy, DDPConfig):
    """Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

    Every rank holds the whole model; gradients are averaged across ranks in buckets during
    backward, optionally compressed by one of PyTorch's DDP communication hooks. The options
    are :class:`~axon_nb.spec.parallel_config.DDPConfig`'s.

    Example::

        from axon_nb import DDP
        cluster.train(model=make_model, data=ds, strategy=DDP(comm_hook="bf16"), steps=100)
    """

    name: ClassVar[str] = "ddp"

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *DDPConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(dp_replicate=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            data_parallel="ddp",
            ddp=config_from(DDPConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
