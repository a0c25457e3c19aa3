"""What tensor parallelism splits of a layer's saved activations, measured: the model run
again with its planned linears cut to half their split features (``model_probe`` calls it
when a model has a plan)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from axon_nb.rank.observe.probe_passes import saved_counter


def measure_split(
    model: nn.Module,
    rows: list[dict[str, Any]],
    batch: tuple[Any, Any],
    loss_fn: Any,
    plan: dict[str, str],
    *,
    layers_of: Callable[[nn.Module], list[nn.Module]],
    forward: Callable[..., Any],
    samples: int,
) -> None:
    """Each layer's ``split_fraction``: run a copy of the model whose planned linears keep half
    their split features (what each of 2 tensor-parallel ranks holds) and compare the saved
    activations: a fraction f of them split halves the layer's bytes by f / 2. ``rows``
    hold each layer's ``saved_bytes`` per sample; ``layers_of`` and ``forward`` are the
    probe's (``model_probe``). Example::

        measure_split(model, rows, (x, y), mse, {"fc1": "colwise"}, layers_of=..., forward=...,
                      samples=4)
    """
    inputs, target = batch

    narrow = copy.deepcopy(model)
    for name, style in plan.items():
        parent, _, child = name.rpartition(".")
        old = cast(nn.Linear, narrow.get_submodule(name))  # (a plan's entries have features)
        width, height = old.in_features, old.out_features
        cut = (width, height // 2) if style == "colwise" else (width // 2, height)
        holder = narrow.get_submodule(parent) if parent else narrow
        new = nn.Linear(cut[0], cut[1], bias=old.bias is not None)
        for mine, theirs in zip(new.parameters(), old.parameters(), strict=True):
            mine.requires_grad_(theirs.requires_grad)  # a frozen layer saves less for backward
        setattr(holder, child, new)
    narrow_layers = layers_of(narrow)
    saved, current, pack = saved_counter(narrow, len(narrow_layers))
    hooks = [
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        for i, layer in enumerate(narrow_layers)
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(narrow, narrow_layers, inputs, target, loss_fn)
    except RuntimeError:  # the model's forward cannot run with narrowed layers
        return
    finally:
        for hook in hooks:
            hook.remove()
    for row, half in zip(rows, saved, strict=True):
        whole = row["saved_bytes"] * samples
        if whole:
            row["split_fraction"] = min(1.0, max(0.0, 2 * (whole - half) / whole))
