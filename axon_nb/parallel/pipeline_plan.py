"""Pipeline layers of a model that is not an ``nn.Sequential``: cut by the model's own pipeline
plan (transformers' ``_pp_plan``, made of ``base_model_pp_plan`` and the head's) or by module
names the user lists (``Pipeline(split=[...])``).

Each planned module becomes one layer that takes one tensor and returns one, so stages can
pass it on: the embedding takes token ids, a decoder block takes and returns hidden states
(its rotary position embeddings and causal mask are made inside the layer from the hidden
states, as the model's own forward makes them), the final norm and the head take hidden
states. A ``ModuleList`` entry (``model.layers``) becomes one layer per block. Batches must be
causal and unpadded on the left: no attention mask travels between stages.

Example::

    layers = plan_layers(llama)                    # embed, 4 blocks, norm, lm_head
    layers = plan_layers(llama, ["model.embed_tokens", "model.layers", "model.norm", "lm_head"])
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def has_plan(model: nn.Module) -> bool:
    """Whether ``model`` carries a pipeline plan of its own (a transformers model)."""
    return bool(getattr(model, "_pp_plan", None))


def plan_layers(model: nn.Module, split: Sequence[str] | None = None) -> list[nn.Module]:
    """``model``'s pipeline layers in forward order: from ``split`` (module names) when given,
    else from its ``_pp_plan``. ``ValueError`` naming the nearest modules for a name that
    matches none."""
    names = list(split) if split is not None else _planned(model)
    if not names:
        raise TypeError(cannot_cut(model))
    rotary = _rotary(model)
    causal_mask = _causal_mask_kind(model)
    layers: list[nn.Module] = []
    for name in names:
        module = _submodule(model, name)
        if isinstance(module, nn.ModuleList):
            layers += [_Block(block, rotary, causal_mask) for block in module]
        elif _takes_positions(module):
            layers.append(_Block(module, rotary, causal_mask))
        else:
            layers.append(_OneTensor(module))
    _check_tied(model, layers)
    return layers


def cannot_cut(model: nn.Module) -> str:
    """What to do when a pipeline cannot cut ``model``: both ways to make it work."""
    top = [name for name, _ in model.named_children()]
    return (
        f"Pipeline cannot cut {type(model).__name__}: it has no pipeline plan (transformers' "
        "base_model_pp_plan), is no nn.Sequential and has no pipeline_layers() method. Pass "
        "Pipeline(split=[module names in forward order]) (a ModuleList gives one layer per "
        f"entry; its top-level modules are {top}), or give the model a pipeline_layers() "
        "method returning its layers in forward order, each taking and returning one tensor"
    )


def first_input_name(model: nn.Module) -> str:
    """The batch key the first planned layer reads (``input_ids``, ``pixel_values``)."""
    plan = getattr(model, "_pp_plan", None) or {}
    planned = _planned(model)
    return str(plan[planned[0]][0][0]) if planned else "input_ids"


def _planned(model: nn.Module) -> list[str]:
    """The modules of ``model``'s plan in forward order: the order the model registers them
    (the plan itself lists the head before the base model's modules)."""
    plan = getattr(model, "_pp_plan", None) or {}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(plan, key=lambda name: order.get(name, len(order)))


class _OneTensor(nn.Module):
    """A planned module run on one tensor; a tuple output gives its first element."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.module(x))


class _Block(nn.Module):
    """A decoder block run on hidden states alone: positions ``0..T-1``, the rotary position
    embeddings made from them (``rotary``: a private copy of the model's, buffers only) and a
    causal mask where the attention kind needs one passed."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None, causal_mask: bool) -> None:
        super().__init__()
        self.block = block
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        self.causal_mask = causal_mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        length = hidden.shape[1]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"position_ids": positions}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
        mask = None
        if self.causal_mask:  # eager attention adds its mask; sdpa is causal without one
            blocked = torch.ones(length, length, dtype=torch.bool, device=hidden.device).triu(1)
            mask = torch.zeros(length, length, dtype=hidden.dtype, device=hidden.device)
            mask = mask.masked_fill(blocked, torch.finfo(hidden.dtype).min)[None, None]
        return _first(self.block(hidden, attention_mask=mask, **kwargs))


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return output[0]
    for key in ("last_hidden_state", "logits", "hidden_states"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(
        f"a pipeline layer must return a tensor (or a tuple starting with one); "
        f"{type(output).__name__} came back"
    )


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        import difflib

        known = [n for n, _ in model.named_modules() if n]
        nearest = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
        raise ValueError(
            f"Pipeline split names {name!r}, which is no module of {type(model).__name__}; "
            f"nearest: {nearest or known[:5]}"
        ) from None


def _takes_positions(module: nn.Module) -> bool:
    return "position_embeddings" in inspect.signature(module.forward).parameters


def _rotary(model: nn.Module) -> nn.Module | None:
    """The model's rotary position embedding module (``model.rotary_emb``), if it has one."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "rotary_emb":
            return module
    return None


def _causal_mask_kind(model: nn.Module) -> bool:
    """Whether blocks need the causal mask passed (eager attention) rather than making it
    themselves (sdpa and flash attention are causal when given none)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None) or "eager"
    return kind == "eager"


def _check_tied(model: nn.Module, layers: list[nn.Module]) -> None:
    """Refuse a parameter shared by two layers (tied embeddings and head): stages on
    different ranks cannot share it."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            first = owner.setdefault(id(param), index)
            if first != index:
                raise ValueError(
                    f"{type(model).__name__} shares a parameter between pipeline layers {first} "
                    f"and {index} (tied input embeddings and head): stages on different ranks "
                    "cannot share it. Build the model with tie_word_embeddings=False, or list "
                    "layers that keep the tied modules in one stage with Pipeline(split=...)"
                )
