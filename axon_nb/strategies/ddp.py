"""``DDP``: PyTorch's DistributedDataParallel, with its gradient compression hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class DDP(Strategy):
    """Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

    Every rank holds the whole model; gradients are averaged across ranks in buckets during
    backward, optionally compressed by one of PyTorch's DDP communication hooks.

    Example::

        from axon_nb import DDP
        cluster.train(model=make_model, data=ds, strategy=DDP(comm_hook="bf16"), steps=100)
    """

    name: ClassVar[str] = "ddp"

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (DDP's ``bucket_cap_mb``)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (costs a graph walk per step)."""
    static_graph: bool = False
    """Promise the set of used parameters never changes (enables DDP's static-graph tricks)."""
    comm_hook: str | None = None
    """Gradient compression: None (fp32 all-reduce), ``"fp16"``, ``"bf16"`` or ``"powersgd"``."""
    powersgd_rank: int = 1
    """Rank of PowerSGD's low-rank approximation (higher is more accurate, more bytes)."""
    powersgd_start_step: int = 10
    """Steps of plain all-reduce before PowerSGD starts compressing (PowerSGD's warm start)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's communication buckets, so they exist once, not twice
    (DDP's ``gradient_as_bucket_view``); ``False`` keeps a separate copy."""

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *self._ddp().problems()]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(dp_replicate=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            data_parallel="ddp",
            ddp=self._ddp(),
            activation_checkpointing=self._checkpoint_every(),
        )

    def _ddp(self) -> DDPConfig:
        return DDPConfig(
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            comm_hook=self.comm_hook,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_step=self.powersgd_start_step,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
