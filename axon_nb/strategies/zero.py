"""``ZeRO``: DeepSpeed's stages of sharding, on PyTorch's own machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import Strategy
from axon_nb.strategies.ddp import DDP
from axon_nb.strategies.fsdp import FSDP

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeRO(DDP):
    """ZeRO stage 1, 2 or 3, with DeepSpeed's meaning.

    - stage 1: parameters and gradients stay whole on every rank (DDP all-reduces the
      gradients); only the optimizer state is sharded (``ZeroRedundancyOptimizer``: each rank
      updates its share of the parameters, then broadcasts them).
    - stage 2: parameters stay whole; gradients are reduce-scattered in buckets during
      backward, so each rank keeps only its shard of them and of the optimizer state
      (``axon_nb.parallel.zero2``; PyTorch has no stage 2).
    - stage 3: parameters, gradients and optimizer state are all sharded (FSDP2 full_shard).

    Stages 1 and 2 need a named optimizer (``optimizer=("adamw", {...})``) that acts
    elementwise; ``bucket_cap_mb`` sets the gradient bucket size of stages 1 and 2.

    Example::

        from axon_nb import ZeRO
        cluster.train(model=make_gpt, data=ds, strategy=ZeRO(stage=1), steps=100,
                      optimizer=("adamw", {"lr": 3e-4}))
    """

    name: ClassVar[str] = "zero"

    stage: int = 1
    """1: optimizer state sharded; 2: gradients too; 3: parameters too."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeRO stage must be 1, 2 or 3 (1: optimizer state sharded, 2: also "
                f"gradients, 3: also parameters), got {self.stage!r}"
            )
        DDP.__post_init__(self)

    def check_spec(self, spec: Any, world_size: int) -> None:
        if self.stage == 2 and spec.mixed_precision == "fp16":
            raise ValueError(
                "ZeRO stage 2 with fp16: the gradient scaler would see only this rank's shard "
                "of the gradients, so ranks could disagree on skipping a step. Use "
                "mixed_precision='bf16' (no scaler), or stage 1 or 3"
            )

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        if self.stage == 3:
            return FSDP(sharding="full_shard").parallelize(model, ctx)
        if self.stage == 2:
            from axon_nb.parallel.zero2 import GradShardedModel

            return GradShardedModel(
                model, ctx.rank, ctx.world_size, bucket_cap_mb=self.bucket_cap_mb
            )
        return DDP.parallelize(self, model, ctx)

    def build_optimizer(self, model: nn.Module, make: Any) -> torch.optim.Optimizer:
        if self.stage == 3:
            return make(model.parameters())
        if make.cls is None:
            raise ValueError(
                f"ZeRO stage {self.stage} shards a named optimizer: pass "
                "optimizer=('adamw', {...}), not a callable"
            )
        if self.stage == 2:
            return model.build_optimizer(make.cls, **make.kwargs)  # type: ignore[operator]
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), make.cls, **make.kwargs)

    def no_sync(self, model: nn.Module) -> Any:
        if self.stage == 3:
            return FSDP().no_sync(model)
        return DDP.no_sync(self, model)  # DDP and GradShardedModel both have no_sync()

    def forward_backward(self, model: nn.Module, microbatches: Any, step: Any) -> torch.Tensor:
        loss = Strategy.forward_backward(self, model, microbatches, step)
        if self.stage == 2:
            model.finish_backward()  # type: ignore[operator]
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.stage == 3:
            return FSDP().clip_grad_norm(model, max_norm)
        if self.stage == 2:
            return model.clip_grad_norm(max_norm)  # type: ignore[operator]
        return DDP.clip_grad_norm(self, model, max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model if self.stage == 3 else DDP.unwrap(self, model)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        if self.stage == 3:
            return FSDP().state_dict(model)
        return DDP.state_dict(self, model)

    def get_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool
    ) -> dict[str, Any]:
        if self.stage == 3:
            return Strategy.get_state(self, model, optimizer, full=full)
        # Parameters are whole on every rank; the optimizer state is gathered to its
        # unsharded form (on every rank, so checkpoint writes can be spread over the ranks).
        module = self.unwrap(model)
        names = [n for n, _ in module.named_parameters()]
        model_state = {k: v.detach() for k, v in module.state_dict().items()}
        if self.stage == 2:
            optim_state = model.full_optimizer_state(optimizer)  # type: ignore[operator]
        else:
            optim_state = _consolidated(optimizer, names)
        if full:
            model_state = {k: v.cpu().clone() for k, v in model_state.items()}
        return {"model": model_state, "optimizer": optim_state}

    def set_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if self.stage == 3:
            return Strategy.set_state(self, model, optimizer, state)
        module = self.unwrap(model)
        module.load_state_dict(state["model"])  # copies into the (bucket) storage in place
        if state["optimizer"] is None:
            return
        if self.stage == 2:
            model.load_full_optimizer_state(optimizer, state["optimizer"])  # type: ignore[operator]
            return
        index = {n: i for i, (n, _) in enumerate(module.named_parameters())}
        optim = state["optimizer"]
        optimizer.load_state_dict(
            {
                "state": {index[n]: dict(v) for n, v in optim["state"].items()},
                "param_groups": [
                    {**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]
                ],
            }
        )


def _consolidated(optimizer: Any, names: list[str]) -> dict[str, Any]:
    """ZeroRedundancyOptimizer's state, gathered from its owners, keyed by parameter name."""
    import torch.distributed as dist

    optimizer.consolidate_state_dict(to=0)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        state = optimizer.state_dict()
        state["state"] = {  # CPU copies: pickling a CUDA tensor would pin it to rank 0's GPU
            i: {k: v.cpu() if hasattr(v, "cpu") else v for k, v in entry.items()}
            for i, entry in state["state"].items()
        }
        box = [state]
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
