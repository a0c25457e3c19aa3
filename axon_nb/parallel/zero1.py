"""ZeRO stage 1: whole parameters and gradients (DDP), optimizer state sharded with PyTorch's
``ZeroRedundancyOptimizer`` (each rank updates its share of the parameters, then broadcasts).

Only trainable parameters are handed to it: frozen ones get no state and are never broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from axon_nb.parallel.optim_state import by_index, by_name
from axon_nb.parallel.param_groups import check_built

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


def build_optimizer(groups: list[dict[str, Any]], factory: Any, group: Any) -> Any:
    """An optimizer over ``groups`` (the run's parameter groups) whose state is sharded over
    ``group``: of ``factory.cls`` with its settings, or what the user's callable builds over
    this rank's share (in the same groups)."""
    # Imported here: torch.distributed.optim is 0.15 s of CPU per rank that only ZeRO-1 needs.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if factory.cls is not None:
        return ZeroRedundancyOptimizer(groups, factory.cls, process_group=group, **factory.kwargs)

    def local(share: list[dict[str, Any]], **_: Any) -> torch.optim.Optimizer:
        built = factory(share)
        check_built(built, share, keep_groups=True)
        return built

    # (it takes a class, and only calls it: a function that builds the optimizer does too)
    zero = ZeroRedundancyOptimizer(
        groups, cast(type[torch.optim.Optimizer], local), process_group=group
    )
    # What the callable chose (lr, betas, ...) becomes the shared groups' settings too: the
    # scheduler and checkpoints read and set them there.
    for shared, own in zip(zero.param_groups, zero.optim.param_groups, strict=True):
        for key, value in own.items():
            if key != "params":
                shared.setdefault(key, value)
    return zero


def full_optimizer_state(
    optimizer: ZeroRedundancyOptimizer, names: list[str], group: Any
) -> dict[str, Any]:
    """The whole optimizer state, gathered from its owners, keyed by name, on every rank;
    ``names``: the optimizer's parameters' names, group after group."""
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
    optimizer: ZeroRedundancyOptimizer, named: dict[str, Any], groups: Sequence[Sequence[str]]
) -> None:
    """Load a state made by :func:`full_optimizer_state` (from any world size); ``groups``:
    the names of each of the optimizer's parameter groups."""
    optimizer.load_state_dict(by_index(named, groups))
