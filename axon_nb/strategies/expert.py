"""``ExpertParallel``: a mixture-of-experts model's experts split over ranks, tokens sent there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, ExpertConfig, FSDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims, positive
from axon_nb.strategies.base import Strategy, config_from, divisors

DATA_PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True, repr=False)
class ExpertParallel(Strategy, ExpertConfig):
    """Expert parallelism: each MoE layer's experts are split over ``ep`` ranks, and every
    token goes to the rank that holds its experts and back (per layer: an ``all_to_all`` of
    the per-expert counts, then one of the tokens each way, and the same two in backward).
    Each rank reads its own data; everything that is not an expert is replicated
    (``data_parallel="ddp"``) or sharded (``"fsdp"``) over all the ranks. With more ranks than
    ``ep``, each expert is held by ``world_size / ep`` ranks, whose gradients are averaged.

    The experts modules are the model's own (``GPTConfig(experts=8)``'s ``GroupedExperts``, a
    transformers MoE model's ``base_model_ep_plan``) or those ``plan`` names
    (:class:`~axon_nb.spec.parallel_config.ExpertConfig`'s option).

    Example::

        from axon_nb import ExpertParallel
        from axon_nb.models import GPT, GPTConfig, lm_loss
        cluster.train(model=lambda: GPT(GPTConfig(experts=8, top_k=2)), data=ds, loss=lm_loss,
                      strategy=ExpertParallel(ep=2), steps=100)
    """

    name: ClassVar[str] = "expert"
    shown: ClassVar[tuple[str, ...]] = ("ep",)

    ep: int = 2
    """Ranks the experts of each layer are split over (it must divide the number of experts)."""
    data_parallel: str = "ddp"
    """How the other parameters are held: ``"ddp"`` (replicated) or ``"fsdp"`` (sharded)."""

    def problems(self) -> list[str]:
        errors = Strategy.problems(self)
        if not positive(self.ep) or self.ep < 2:
            errors.append(f"ep must be an integer >= 2 (ranks per expert group), got {self.ep!r}")
        if self.data_parallel not in DATA_PARALLEL:
            errors.append(f"data_parallel must be 'ddp' or 'fsdp', got {self.data_parallel!r}")
        return errors + ExpertConfig.problems(self)

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        if world_size % self.ep:
            raise ValueError(
                f"ExpertParallel(ep={self.ep}) needs the world size to be a multiple of ep, "
                f"but there are {world_size} ranks. Use ep among {divisors(world_size)[1:]}"
            )
        rest = world_size // self.ep
        if self.data_parallel == "ddp":
            return ParallelDims(dp_replicate=rest, ep=self.ep, world_size=world_size)
        return ParallelDims(dp_shard=rest, ep=self.ep, world_size=world_size)

    def config(self) -> ParallelConfig:
        fsdp = self.data_parallel == "fsdp"
        return ParallelConfig(
            data_parallel=self.data_parallel,
            ddp=None if fsdp else DDPConfig(),
            fsdp=FSDPConfig() if fsdp else None,
            expert=config_from(ExpertConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
