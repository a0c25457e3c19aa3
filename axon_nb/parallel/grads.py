"""Gradient-norm clipping for every layout: whole, DTensor-sharded, or split across ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, *, group: Any = None
) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most ``max_norm``; returns that norm.

    A DTensor gradient contributes its local shard, summed over the mesh axes it is sharded
    on (one all-reduce per distinct set of axes, not per tensor). ``group``: the ranks whose
    plain gradients are *different* pieces of the model (pipeline stages, ZeRO-2 shards),
    whose squared norms are summed too. Example::

        clip_grad_norm_(stage.parameters(), 1.0, group=pp_group)
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    squares: dict[tuple[Any, ...], torch.Tensor] = {}  # insertion order: the same on peers
    for g in grads:
        key = _sharded_groups(g)
        square = torch.linalg.vector_norm(_local(g).float()).pow(2)
        squares[key] = squares.get(key, torch.zeros((), device=device)) + square
    total = torch.zeros((), device=device)
    for key, square in squares.items():
        for axis_group in key:
            dist.all_reduce(square, group=axis_group)
        total = total + square
    if group is not None:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # a tensor: no wait for the device
    for g in grads:
        _local(g).mul_(scale.to(g.dtype))
    return norm


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _sharded_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Process groups of the mesh axes a DTensor is sharded on (empty for a plain tensor)."""
    if not hasattr(tensor, "placements"):
        return ()
    sharded = cast("DTensor", tensor)
    return tuple(
        sharded.device_mesh.get_group(axis)
        for axis, placement in enumerate(sharded.placements)
        if placement.is_shard()
    )
