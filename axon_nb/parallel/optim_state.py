"""Optimizer state keyed by parameter name: the layout checkpoints store.

``torch.optim`` keys state by a parameter's position in the optimizer; positions differ
between layouts (a ZeRO-2 bucket shard, a pipeline rank's stages), names do not. Every layout
converts through these functions, so a checkpoint of one loads into any other, with each
parameter group's own settings (learning rate, weight decay)::

    named = by_name(optimizer.state_dict(), names)          # {"state": {name: {...}}, ...}
    optimizer.load_state_dict(by_index(named, group_names))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def by_name(state_dict: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``state_dict`` (keyed by position) keyed by ``names[position]`` instead."""
    return {
        "state": {names[i]: entry for i, entry in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }


def by_index(named: dict[str, Any], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """A state dict for an optimizer whose parameter groups hold the parameters named
    ``groups`` (in the optimizer's order), from one keyed by name; state of parameters it does
    not hold is dropped (another rank's pipeline stages). Each group keeps its saved settings.
    ``ValueError`` when the saved groups hold other parameters than these."""
    check_same_groups(named["param_groups"], groups)
    position = {name: i for i, name in enumerate(n for group in groups for n in group)}
    return {
        "state": {position[n]: dict(v) for n, v in named["state"].items() if n in position},
        "param_groups": [
            {**settings(saved), "params": [position[n] for n in mine]}
            for saved, mine in zip(named["param_groups"], groups, strict=True)
        ],
    }


def settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings, without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def check_same_groups(saved: Sequence[dict[str, Any]], groups: Sequence[Sequence[str]]) -> None:
    """``ValueError`` unless group i of ``saved`` holds, of the parameters named in ``groups``,
    exactly those of group i (a pipeline rank holds only some of each group)."""
    problem = groups_problem([g["params"] for g in saved], groups)
    if problem is not None:
        raise ValueError(
            f"the saved optimizer groups its parameters differently from this run ({problem}); "
            f"{SAME_GROUPS}"
        )


SAME_GROUPS = (
    "build the run with the same param_groups= and no_decay= (and the same frozen parameters) "
    "as the run that saved it"
)


def groups_problem(
    saved: Sequence[Sequence[str]], groups: Sequence[Sequence[str]], *, some: bool = True
) -> str | None:
    """How the saved groups' parameter names differ from ``groups``', or None where they do
    not; ``some``: ``groups`` name only some of the parameters (a pipeline rank's), compare
    those."""
    held = {n for group in groups for n in group}
    if len(saved) != len(groups):
        return f"it has {len(saved)} parameter group(s), this run {len(groups)}"
    for index, (theirs, mine) in enumerate(zip(saved, groups, strict=True)):
        differ = sorted((set(theirs) & held if some else set(theirs)) ^ set(mine))
        if differ:
            where = "there" if differ[0] in theirs else "here"
            return f"{differ[0]!r} is in its group {index} only {where}"
    return None


def merge_groups(per_rank: Sequence[Sequence[dict[str, Any]]], order: Sequence[str]) -> list:
    """Each group's parameters over every rank's groups (by name, as :func:`by_name` gives
    them; the same groups, in the same order, on every rank), listed in ``order``."""
    rank = {name: i for i, name in enumerate(order)}
    merged = []
    for index, group in enumerate(per_rank[0]):
        names = {n for groups in per_rank for n in groups[index]["params"]}
        merged.append({**settings(group), "params": sorted(names, key=rank.__getitem__)})
    return merged


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (moments, step counters) with one step of zero gradients
    at learning rate 0, if it has none yet; the parameters do not change. A sharded load reads
    into the run's own state, so every state tensor must exist first; DCP's loads make it so
    themselves, through the optimizer's own step, which DiLoCo's and AsyncSGD's would not
    leave as it was (an outer step; or none at all in AsyncSGD's first steps)."""
    import torch

    from axon_nb.parallel.strategy_state import kept_by

    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if local.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    # (DiLoCo's and AsyncSGD's own step would take an outer step, or skip: the inner one's)
    (local if kept_by(optimizer) is not None else optimizer).step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def on_cpu(state: Any) -> Any:
    """``state`` (nested dicts and lists of tensors) with every tensor on the CPU."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state
