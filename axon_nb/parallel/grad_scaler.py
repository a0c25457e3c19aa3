"""fp16 loss scaling when each rank sees only part of the gradients.

With sharded gradients (ZeRO-2, FSDP) or split models (pipeline stages, tensor parallelism)
one rank can find an inf where another finds none; if they disagreed, some would skip the step
and others take it. :class:`GradScaler` takes the step only when no rank found one, as
``ShardedGradScaler`` does for FSDP1, and also unscales DTensor gradients (FSDP2, TP) through
their local shards.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is agreed over ``group`` (all ranks).

    Example::

        scaler = GradScaler("cuda")          # in an initialized process group
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
    """

    def __init__(self, device: str, *, group: Any = None) -> None:
        super().__init__(device)
        self.group = group
        # A pipeline's first stages never call scale() (the loss is on the last stage), yet
        # must unscale the gradients they receive: create the scale now, not on first use.
        self._lazy_init_scale_growth_tracker(torch.device(device))

    def _unscale_grads_(  # the hook PyTorch's own ShardedGradScaler overrides
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grads[grad.device, grad.dtype].append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                if device not in found:
                    found[device] = found_inf.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    tensors, found[device], inv_scale.to(device)
                )
            if not found:  # no gradients here (an idle stage): still take part in the vote
                found[found_inf.device] = found_inf
            # One vote per rank, whatever devices its gradients are on.
            vote = torch.stack([flag.to(found_inf.device) for flag in found.values()]).amax()
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
            for flag in found.values():
                flag.copy_(vote)
        return found
