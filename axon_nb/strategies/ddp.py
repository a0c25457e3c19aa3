"""``DDP``: PyTorch's DistributedDataParallel, with its gradient compression hooks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import Strategy

if TYPE_CHECKING:
    from torch import nn

    from axon_nb.engine.runtime import RankContext

COMM_HOOKS = (None, "fp16", "bf16", "powersgd")


@dataclass(frozen=True, kw_only=True, slots=True)
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

    def __post_init__(self) -> None:
        errors = []
        if self.comm_hook not in COMM_HOOKS:
            errors.append(
                f"comm_hook must be None, 'fp16', 'bf16' or 'powersgd', got {self.comm_hook!r}"
            )
        if not self.bucket_cap_mb > 0:
            errors.append(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        if not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            errors.append(f"powersgd_rank must be an integer >= 1, got {self.powersgd_rank!r}")
        if not isinstance(self.powersgd_start_step, int) or self.powersgd_start_step < 2:
            errors.append(
                f"powersgd_start_step must be an integer >= 2 (PowerSGD needs plain all-reduce "
                f"steps first), got {self.powersgd_start_step!r}"
            )
        if errors:
            raise ValueError("invalid DDP options:\n  - " + "\n  - ".join(errors))

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )
        state, hook = self._hook(ctx.backend)
        ddp.register_comm_hook(state, hook)
        return ddp

    def _hook(self, backend: str) -> tuple[Any, Any]:
        # Always a Python hook, even for plain fp32: its all-reduce goes through
        # torch.distributed.all_reduce, where the metrics probe measures bytes and time.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_step,
            )
            return state, powerSGD_hook.powerSGD_hook
        hooks = {
            None: default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook if backend == "nccl" else _bf16_hook,
        }
        return None, hooks[self.comm_hook]

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return model.no_sync()  # type: ignore[operator,return-value]

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module  # type: ignore[return-value]


def _bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """PyTorch's ``bf16_compress_hook`` under another name, for gloo.

    (Unannotated on purpose: DDP compares a hook's annotations with ``dist.GradBucket``.)

    DDP refuses that hook by name unless NCCL >= 2.10 is present (an NCCL requirement);
    gloo all-reduces bfloat16 fine, so on gloo it is registered through this wrapper.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
