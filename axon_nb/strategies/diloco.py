"""``DiLoCo``: data parallelism that talks every ``inner_steps`` steps, not every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, DiLoCoConfig, FSDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class DiLoCo(Strategy, DiLoCoConfig):
    """DiLoCo (Douillard et al., 2023; torchft's ``DiLoCo``): every rank holds the whole model
    and steps its inner optimizer (the ``optimizer=`` of ``train``) on its own gradients; every
    ``inner_steps`` steps the mean over the ranks of (global minus local parameters) is the
    outer gradient, which an outer SGD (``outer_lr``, ``outer_momentum``, ``nesterov``) applies
    to the global parameters, and every rank goes on from them. One all-reduce of the model
    per ``inner_steps`` steps (``compress="bf16"`` halves it); the first outer step comes after
    the first inner step. With ``inner_steps=1, outer_lr=1, outer_momentum=0, nesterov=False``
    and inner SGD it trains exactly as DDP; with ``outer_lr=1, outer_momentum=0`` it is
    ``LocalSGD(period=inner_steps)``. With ``shard_size=k`` each worker is a group of ``k``
    ranks that shards its model with FSDP (the outer loop works on each rank's shards). See
    ``parallel/diloco.py``.

    Example::

        from axon_nb import DiLoCo
        cluster.train(model=make_model, data=ds, strategy=DiLoCo(inner_steps=50), steps=1000,
                      batch_size=64)
    """

    name: ClassVar[str] = "diloco"
    shown: ClassVar[tuple[str, ...]] = ("inner_steps", "outer_lr", "compress")

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *DiLoCoConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        if world_size % self.shard_size:
            raise ValueError(
                f"DiLoCo(shard_size={self.shard_size}) needs a number of ranks it divides, "
                f"got {world_size}: each worker is a group of shard_size ranks"
            )
        workers = world_size // self.shard_size
        return ParallelDims(dp_replicate=workers, dp_shard=self.shard_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        sharded = self.shard_size > 1  # (each worker's model sharded by FSDP)
        return ParallelConfig(
            data_parallel="fsdp" if sharded else "ddp",
            ddp=None if sharded else DDPConfig(),
            fsdp=FSDPConfig() if sharded else None,
            diloco=config_from(DiLoCoConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
