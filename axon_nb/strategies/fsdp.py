"""``FSDP``: fully sharded data parallelism (PyTorch's FSDP2 ``fully_shard``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import FSDPConfig, ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims, positive
from axon_nb.strategies.base import Strategy, config_from, divisors

SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


@dataclass(frozen=True, kw_only=True, repr=False)
class FSDP(Strategy):
    """Shard parameters, gradients and optimizer state across ranks with FSDP2.

    - ``full_shard``: parameters are gathered for each unit's forward and backward and
      resharded after forward (least memory).
    - ``shard_grad_op``: parameters stay gathered from forward to backward (less communication).
    - ``no_shard``: every rank keeps everything; gradients are all-reduced (DDP's behaviour).
    - ``hybrid_shard``: shard within groups of ``shard_size`` ranks (default: the ranks on one
      host), replicate across groups, over a 2-D device mesh.

    Example::

        from axon_nb import FSDP
        cluster.train(model=make_gpt, data=ds, strategy=FSDP(sharding="full_shard"), steps=100)
    """

    name: ClassVar[str] = "fsdp"

    sharding: str = "full_shard"
    """``full_shard``, ``shard_grad_op``, ``no_shard`` or ``hybrid_shard``."""
    shard_size: int | None = None
    """Ranks per shard group for ``hybrid_shard`` (default: ranks per host)."""
    auto_wrap: tuple[str, ...] | None = None
    """Class names of the submodules sharded as their own units (default: ``ModuleList`` items)."""
    min_params: int | None = None
    """Instead of classes: leaf modules with at least this many parameters become units."""
    param_dtype: str | None = None
    """Compute dtype of gathered parameters (``"bf16"``, ``"fp16"``), or None (as stored)."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduction, or None (the parameter dtype)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU between uses (GPU
    ranks; on CPU ranks everything is on the CPU already)."""
    reshard_after_forward: bool | None = None
    """Override the sharding mode's choice of resharding parameters after forward."""

    def problems(self) -> list[str]:
        errors = [*Strategy.problems(self), *self._fsdp().problems()]
        errors += sharding_problems(self.sharding, self.shard_size)
        return errors

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        replicate, shard = split_data_parallel(
            world_size, self.sharding, self.shard_size or ranks_per_host
        )
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            data_parallel="fsdp",
            fsdp=self._fsdp(),
            activation_checkpointing=self._checkpoint_every(),
        )

    def _fsdp(self) -> FSDPConfig:
        reshard = self.reshard_after_forward
        if reshard is None:  # (the sharding mode's choice)
            reshard = self.sharding != "shard_grad_op"
        return config_from(FSDPConfig, self, reshard_after_forward=reshard)


def sharding_problems(sharding: str, shard_size: int | None) -> list[str]:
    """Problems with an FSDP sharding mode and its group size (FSDP and Hybrid's options)."""
    errors = []
    if sharding not in SHARDING:
        errors.append(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
    if shard_size is not None and not positive(shard_size):
        errors.append(f"shard_size must be a positive integer, got {shard_size!r}")
    return errors


def split_data_parallel(dp: int, sharding: str, shard_size: int) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` of ``dp`` data-parallel ranks under an FSDP ``sharding``."""
    if sharding == "no_shard":
        return dp, 1
    if sharding != "hybrid_shard":
        return 1, dp
    if dp % shard_size:
        raise ValueError(
            f"hybrid_shard needs shard_size to divide the world size (its {dp} data-parallel "
            f"ranks): shard_size={shard_size}. Use one of {divisors(dp)}"
        )
    return dp // shard_size, shard_size
