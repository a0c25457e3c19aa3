"""``LocalSGD``: DDP that averages the model every few steps instead of gradients every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, LocalSGDConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class LocalSGD(Strategy, LocalSGDConfig):
    """Post-local SGD (PyTorch's ``PostLocalSGDOptimizer`` and ``post_localSGD_hook``).

    Every rank holds the whole model, as with :class:`~axon_nb.DDP`. For ``warmup_steps``
    steps gradients are all-reduced as DDP does; after that each rank steps on its own
    gradients and the parameters are averaged over the ranks every ``period`` steps: one
    all-reduce of the model per ``period`` steps instead of one of the gradients per step.
    With ``period=1`` and plain SGD it trains exactly as DDP does. Besides ``bucket_cap_mb``,
    the options are :class:`~axon_nb.spec.parallel_config.LocalSGDConfig`'s.

    Example::

        from axon_nb import LocalSGD
        cluster.train(model=make_model, data=ds, strategy=LocalSGD(period=8, warmup_steps=100))
    """

    name: ClassVar[str] = "local_sgd"
    shown: ClassVar[tuple[str, ...]] = ("period",)

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB during the warm-up (DDP's ``bucket_cap_mb``)."""

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *LocalSGDConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(dp_replicate=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            data_parallel="ddp",
            ddp=config_from(DDPConfig, self),
            local_sgd=config_from(LocalSGDConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
