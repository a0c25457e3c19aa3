"""``FSDP``: fully sharded data parallelism (PyTorch's FSDP2 ``fully_shard``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext

SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


@dataclass(frozen=True, kw_only=True, slots=True)
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
    activation_checkpointing: bool = False
    """Recompute the activations of every ``interval``-th block in backward (less memory)."""
    interval: int = 1
    """With ``activation_checkpointing``: checkpoint blocks 0, interval, 2 x interval, ..."""

    def __post_init__(self) -> None:
        errors = []
        if self.sharding not in SHARDING:
            errors.append(f"sharding must be one of {', '.join(SHARDING)}, got {self.sharding!r}")
        if self.shard_size is not None and (
            not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            errors.append(f"shard_size must be a positive integer, got {self.shard_size!r}")
        for field_name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field_name)
            if value not in (None, "bf16", "fp16", "fp32"):
                errors.append(f"{field_name} must be 'bf16', 'fp16', 'fp32' or None, got {value!r}")
        if not isinstance(self.interval, int) or self.interval < 1:
            errors.append(
                f"activation checkpoint interval must be an integer >= 1, got {self.interval!r}"
            )
        if errors:
            raise ValueError("invalid FSDP options:\n  - " + "\n  - ".join(errors))

    def check_world(self, world_size: int) -> None:
        size = self.shard_size if self.sharding == "hybrid_shard" else None
        if size is not None and world_size % size:
            raise ValueError(
                f"hybrid_shard needs shard_size to divide the world size: shard_size={size}, "
                f"world_size={world_size}. Use one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        from axon_nb.parallel.checkpointing import apply_activation_checkpointing
        from axon_nb.parallel.fsdp import apply_fsdp, wrap_targets

        # Order matters: checkpoint the blocks first, then shard what was wrapped.
        if self.activation_checkpointing:
            apply_activation_checkpointing(model, self.interval)
        units = wrap_targets(model, self.auto_wrap, self.min_params)
        shard = {
            "full_shard": ctx.world_size,
            "shard_grad_op": ctx.world_size,
            "no_shard": 1,  # replicate over a (world, 1) mesh: nothing is sharded
            "hybrid_shard": self.shard_size or ctx.local_world_size,
        }[self.sharding]
        if ctx.world_size % shard:
            raise ValueError(
                f"hybrid_shard groups of {shard} ranks do not divide {ctx.world_size} ranks; "
                "pass shard_size="
            )
        if shard == ctx.world_size:
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(
                ctx.device.type,
                (ctx.world_size // shard, shard),
                mesh_dim_names=("replicate", "shard"),
            )
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = self.sharding != "shard_grad_op"
        return apply_fsdp(
            model,
            mesh,
            units=units,
            reshard_after_forward=reshard,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            cpu_offload=self.cpu_offload,
        )

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _without_gradient_sync(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        import torch

        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Full, unsharded parameters on every rank (a collective: call it on all ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
