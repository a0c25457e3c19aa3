"""ZeRO stage 1: whole parameters and gradients (DDP), optimizer state sharded with PyTorch's
``ZeroRedundancyOptimizer`` (each rank updates its share of the parameters, then broadcasts)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from axon_nb.parallel.optim_state import by_index, by_name


def build_optimizer(
    params: Any, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], group: Any
) -> ZeroRedundancyOptimizer:
    """An optimizer of ``cls`` whose state is sharded over ``group``."""
    return ZeroRedundancyOptimizer(params, cls, process_group=group, **kwargs)


def full_optimizer_state(
    optimizer: ZeroRedundancyOptimizer, names: list[str], group: Any
) -> dict[str, Any]:
    """The whole optimizer state, gathered from its owners, keyed by name, on every rank."""
    first = dist.get_global_rank(group, 0) if group is not None else 0
    optimizer.consolidate_state_dict(to=first)
    box: list[Any] = [None]
    if dist.get_rank() == first:
        state = optimizer.state_dict()
        state["state"] = {  # CPU copies: pickling a CUDA tensor would pin it to one GPU
            i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for i, entry in state["state"].items()
        }
        box = [state]
    dist.broadcast_object_list(box, src=first, group=group)
    return by_name(box[0], names)


def load_optimizer_state(
    optimizer: ZeroRedundancyOptimizer, named: dict[str, Any], names: list[str]
) -> None:
    """Load a state made by :func:`full_optimizer_state` (from any world size)."""
    optimizer.load_state_dict(by_index(named, names))
