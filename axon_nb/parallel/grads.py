"""Gradient-norm clipping over parameters that may be DTensor shards or split across stages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, *, group: Any = None
) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most ``max_norm``; returns that norm.

    A DTensor gradient's norm is taken over its whole tensor (a collective over its mesh);
    ``group``: the ranks whose *different* parameters make up the model (pipeline stages),
    whose squared norms are summed. Example::

        clip_grad_norm_(stage.parameters(), 1.0, group=pp_group)
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), device=device)
    for g in grads:
        norm = torch.linalg.vector_norm(g.float())
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares = squares + norm.pow(2)
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(scale)
    return total
