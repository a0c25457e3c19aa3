"""``AsyncSGD``: data parallelism whose ranks run up to ``staleness`` steps apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import AsyncSGDConfig, DDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class AsyncSGD(Strategy, AsyncSGDConfig):
    """Stale-synchronous data parallelism (bounded staleness, no parameter server): every
    rank holds the whole model and starts the all-reduce of its gradients without waiting;
    step ``t`` applies the mean gradient of step ``t - staleness``, so a rank waits only for
    a peer more than ``staleness`` steps behind, and a transient straggler holds nobody up.
    Every rank applies the same updates in the same order (the run is reproducible and the
    parameters stay equal); the first ``staleness`` steps apply none. ``staleness=0`` is
    DDP. See ``parallel/async_sgd.py``.

    Example::

        from axon_nb import AsyncSGD
        cluster.train(model=make_model, data=ds, strategy=AsyncSGD(staleness=4), steps=1000,
                      batch_size=64)
    """

    name: ClassVar[str] = "async_sgd"
    shown: ClassVar[tuple[str, ...]] = ("staleness",)

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *AsyncSGDConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(dp_replicate=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            data_parallel="ddp",
            ddp=DDPConfig(),
            async_sgd=config_from(AsyncSGDConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
