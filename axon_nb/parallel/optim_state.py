"""Optimizer state keyed by parameter name: the layout checkpoints store.

``torch.optim`` keys state by a parameter's position in the optimizer; positions differ
between layouts (a ZeRO-2 bucket shard, a pipeline rank's stages), names do not. Every layout
converts through these two functions, so a checkpoint of one loads into any other::

    named = by_name(optimizer.state_dict(), names)          # {"state": {name: {...}}, ...}
    optimizer.load_state_dict(by_index(named, names))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def by_name(state_dict: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``state_dict`` (keyed by position) keyed by ``names[position]`` instead."""
    return {
        "state": {names[i]: entry for i, entry in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }


def by_index(named: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A state dict for an optimizer over parameters ``names`` (in that order), from one keyed
    by name; names it does not hold are dropped (another rank's pipeline stages)."""
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[n]: dict(v) for n, v in named["state"].items() if n in position},
        "param_groups": [
            {**group, "params": [position[n] for n in group["params"] if n in position]}
            for group in named["param_groups"]
        ],
    }


def single_group(named: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``named`` with its one parameter group listing ``names`` (for layouts whose optimizer
    sees other parameters than the model's, such as ZeRO-2's bucket shards)."""
    if len(named["param_groups"]) != 1:
        raise NotImplementedError(
            "checkpoints of this layout support one optimizer parameter group; this optimizer "
            f"has {len(named['param_groups'])}"
        )
    group = {k: v for k, v in named["param_groups"][0].items() if k != "params"}
    return {"state": named["state"], "param_groups": [{**group, "params": list(names)}]}
