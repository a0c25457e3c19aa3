"""``ZeRO``: DeepSpeed's stages of sharding, on PyTorch's own machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import DDPConfig, FSDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from

STAGE_OPTIONS = {
    "comm_hook": (1, "stage 1 all-reduces whole gradients through DDP, which takes the hook; "
                     "stages 2 and 3 reduce-scatter gradient shards"),
    "param_dtype": (3, "only stage 3 gathers parameters (FSDP), which can cast them"),
    "reduce_dtype": (3, "only stage 3 reduces through FSDP, which can cast gradients"),
    "cpu_offload": (3, "only stage 3 (FSDP) offloads shards to the CPU"),
}  # fmt: skip
"""Options that only one stage honours: ``name -> (stage, why)``."""


@dataclass(frozen=True, kw_only=True, repr=False)
class ZeRO(Strategy):
    """ZeRO stage 1, 2 or 3, with DeepSpeed's meaning.

    - stage 1: parameters and gradients stay whole on every rank (DDP all-reduces the
      gradients); only the optimizer state is sharded (``ZeroRedundancyOptimizer``: each rank
      updates its share of the parameters, then broadcasts them).
    - stage 2: parameters stay whole; gradients are reduce-scattered in buckets during
      backward, so each rank keeps only its shard of them and of the optimizer state
      (``axon_nb.parallel.zero2``; PyTorch has no stage 2).
    - stage 3: parameters, gradients and optimizer state are all sharded (FSDP2 full_shard).

    Stages 1 and 2 need a named optimizer (``optimizer=("adamw", {...})``) that acts
    elementwise; ``bucket_cap_mb`` sets their gradient bucket size. ``comm_hook`` applies to
    stage 1 only; ``param_dtype``, ``reduce_dtype`` and ``cpu_offload`` to stage 3 only.

    Example::

        from axon_nb import ZeRO
        cluster.train(model=make_gpt, data=ds, strategy=ZeRO(stage=1), steps=100,
                      optimizer=("adamw", {"lr": 3e-4}))
    """

    name: ClassVar[str] = "zero"
    shown: ClassVar[tuple[str, ...]] = ("stage",)

    stage: int = 1
    """1: optimizer state sharded; 2: gradients too; 3: parameters too."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (stages 1 and 2)."""
    comm_hook: str | None = None
    """Stage 1: DDP's gradient compression (None, ``"fp16"``, ``"bf16"``, ``"powersgd"``)."""
    param_dtype: str | None = None
    """Stage 3: compute dtype of gathered parameters."""
    reduce_dtype: str | None = None
    """Stage 3: dtype of gradient reduction."""
    cpu_offload: bool = False
    """Stage 3: keep shards on the CPU between uses (GPU ranks)."""

    def problems(self) -> list[str]:
        if self.stage not in (1, 2, 3):
            return [
                f"ZeRO stage must be 1, 2 or 3 (1: optimizer state sharded, 2: also gradients, "
                f"3: also parameters), got {self.stage!r}"
            ]
        errors = Strategy.problems(self)
        for option, (stage, why) in STAGE_OPTIONS.items():
            if self.stage != stage and getattr(self, option) not in (None, False):
                errors.append(
                    f"{option}={getattr(self, option)!r} is honoured by stage {stage} only "
                    f"({why}); remove it, or use stage={stage}"
                )
        errors += config_from(DDPConfig, self).problems()
        if self.stage == 3:
            errors += self._fsdp().problems()
        return errors

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(dp_shard=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        every = self._checkpoint_every()
        if self.stage == 3:
            return ParallelConfig(
                data_parallel="fsdp", fsdp=self._fsdp(), activation_checkpointing=every
            )
        ddp = config_from(DDPConfig, self)
        return ParallelConfig(
            data_parallel=f"zero{self.stage}",
            ddp=ddp if self.stage == 1 else None,
            bucket_cap_mb=self.bucket_cap_mb,
            activation_checkpointing=every,
        )

    def _fsdp(self) -> FSDPConfig:
        return config_from(FSDPConfig, self)
