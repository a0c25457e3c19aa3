"""``Hybrid``: data, tensor and pipeline parallelism together, over one device mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from axon_nb.spec.parallel_config import (
    DDPConfig,
    ExpertConfig,
    FSDPConfig,
    ParallelConfig,
    PipelineConfig,
    TensorConfig,
)
from axon_nb.spec.parallel_dims import ParallelDims, positive
from axon_nb.strategies.base import Strategy, config_from
from axon_nb.strategies.fsdp import sharding_problems, split_data_parallel

DATA_PARALLEL = ("fsdp", "ddp")
FSDP_ONLY = ("shard_size", "param_dtype", "reduce_dtype", "cpu_offload")


@dataclass(frozen=True, kw_only=True, repr=False)
class Hybrid(Strategy):
    """``dp`` x ``ep`` x ``tp`` x ``pp`` ranks on one mesh (``axon_nb.spec.parallel_dims``):
    the model is cut into ``pp`` pipeline stages, each stage's layers are split over ``tp``
    ranks, and each of those is replicated or sharded over ``dp`` data-parallel ranks. With
    ``ep``, each MoE layer's experts are also split over ``ep`` ranks (see
    :class:`ExpertParallel`).

    The data-parallel axis is FSDP (``data_parallel="fsdp"``, with FSDP's ``sharding`` modes:
    ``hybrid_shard`` shards within groups of ``shard_size`` and replicates across them) or
    plain DDP replication (``data_parallel="ddp"``, without tensor parallelism: DDP does not
    take DTensor parameters; ``sharding="no_shard"`` replicates with FSDP). The degrees must
    multiply to the world size. Pipeline and tensor-parallel options are those of
    :class:`Pipeline` and :class:`TensorParallel`.

    Example::

        from axon_nb import Hybrid
        cluster.train(model=GPT, data=ds, loss=lm_loss, steps=100, batch_size=32,
                      strategy=Hybrid(dp=2, tp=2, pp=2, microbatches=4))
        Hybrid(dp=4, tp=2, sharding="hybrid_shard", shard_size=2)   # 2 replicas x 2 shards
        Hybrid(dp=2, ep=2, data_parallel="ddp")   # experts split in 2, each held twice
    """

    name: ClassVar[str] = "hybrid"

    dp: int = 1
    """Data-parallel degree (with ``ep``: the replicas of each expert)."""
    ep: int = 1
    """Expert-parallel degree (see :class:`ExpertParallel`): each MoE layer's experts are
    split over ``ep`` ranks, which read different data, so everything else is data-parallel
    over ``dp x ep`` ranks."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (ranks along the pipeline; stages are pp x virtual_stages)."""
    data_parallel: str = "fsdp"
    """``"fsdp"`` (sharded, with the options below) or ``"ddp"`` (replicated)."""
    sharding: str = "full_shard"
    """With FSDP: ``full_shard``, ``shard_grad_op``, ``no_shard`` or ``hybrid_shard``."""
    shard_size: int | None = None
    """With ``hybrid_shard``: ranks per shard group (required; it must divide ``dp``)."""
    param_dtype: str | None = None
    """With FSDP: compute dtype of gathered parameters."""
    reduce_dtype: str | None = None
    """With FSDP: dtype of gradient reduction."""
    cpu_offload: bool = False
    """With FSDP: keep shards on the CPU between uses (GPU ranks)."""
    plan: dict[str, Any] | str | None = None
    """Tensor-parallel plan (see :class:`TensorParallel`)."""
    sequence_parallel: bool = False
    """Sequence parallelism in the tensor-parallel layers (not with ``pp > 1`` yet)."""
    microbatches: int = 4
    """Pipeline micro-batches per step."""
    schedule: str = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Pipeline stages per rank."""
    split_points: tuple[int, ...] | None = None
    """First layer index of every pipeline stage after the first."""
    split: tuple[str, ...] | None = None
    """Module names to cut the model into for the pipeline (see :class:`Pipeline`)."""
    expert_plan: tuple[str, ...] | None = None
    """With ``ep``: module-name patterns of the experts modules (see :class:`ExpertParallel`)."""

    def problems(self) -> list[str]:
        errors = Strategy.problems(self)
        bad = [
            f"{a}={getattr(self, a)!r}"
            for a in ("dp", "ep", "tp", "pp")
            if not positive(getattr(self, a))
        ]
        if bad:
            errors.append(f"parallel degrees must be positive integers, got {', '.join(bad)}")
        errors += (
            config_from(TensorConfig, self).problems()
            + config_from(PipelineConfig, self).problems()
        )
        errors += ExpertConfig(plan=self.expert_plan).problems()
        if positive(self.ep) and self.ep > 1:
            if self.sequence_parallel:
                errors.append(
                    "sequence_parallel with ep > 1 is not supported yet: the experts take whole "
                    "sequences; use sequence_parallel=False"
                )
            if self.sharding == "hybrid_shard":
                errors.append(
                    "ep with sharding='hybrid_shard' is not supported yet: use full_shard, or "
                    "data_parallel='ddp'"
                )
        if self.data_parallel not in DATA_PARALLEL:
            errors.append(f"data_parallel must be 'fsdp' or 'ddp', got {self.data_parallel!r}")
        elif self.data_parallel == "ddp":
            if self.tp > 1:
                errors.append(
                    "data_parallel='ddp' with tp > 1: PyTorch's DDP does not take tensor-parallel "
                    "(DTensor) parameters. Replicate with data_parallel='fsdp', "
                    "sharding='no_shard' instead"
                )
            set_here = [o for o in FSDP_ONLY if getattr(self, o) not in (None, False)]
            if self.sharding != "full_shard":
                set_here.insert(0, "sharding")
            if set_here:
                errors.append(
                    f"{', '.join(set_here)} configure FSDP, but data_parallel='ddp' replicates "
                    "whole models: remove them, or use data_parallel='fsdp'"
                )
        else:
            errors += sharding_problems(self.sharding, self.shard_size) + self._fsdp().problems()
            if self.sharding == "hybrid_shard" and self.shard_size is None:
                errors.append("sharding='hybrid_shard' needs shard_size= (ranks per shard group)")
        if self.sequence_parallel and self.pp > 1:
            errors.append(
                "sequence_parallel with pipeline stages (pp > 1) is not supported yet: use "
                "sequence_parallel=False, or pp=1"
            )
        return errors

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        if self.data_parallel == "ddp":
            replicate, shard = self.dp, 1
        else:
            replicate, shard = split_data_parallel(self.dp, self.sharding, self.shard_size or 1)
        return ParallelDims(
            dp_replicate=replicate,
            dp_shard=shard,
            ep=self.ep,
            tp=self.tp,
            pp=self.pp,
            world_size=world_size,
        )

    def config(self) -> ParallelConfig:
        fsdp = self.data_parallel == "fsdp"
        return ParallelConfig(
            data_parallel=self.data_parallel if self.dp * self.ep > 1 else "none",
            ddp=None if fsdp else DDPConfig(),
            fsdp=self._fsdp() if fsdp else None,
            tensor=config_from(TensorConfig, self),
            pipeline=config_from(PipelineConfig, self),
            expert=ExpertConfig(plan=self.expert_plan),
            activation_checkpointing=self._checkpoint_every(),
        )

    def _fsdp(self) -> FSDPConfig:
        reshard = self.sharding != "shard_grad_op"
        return config_from(FSDPConfig, self, reshard_after_forward=reshard)
