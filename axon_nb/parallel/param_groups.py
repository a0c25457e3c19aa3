"""Optimizer parameter groups: which settings each trainable parameter trains with.

``train(param_groups=fn, no_decay="bias_and_norm")`` is decided once, on the user's model
before any strategy wraps, shards or cuts it, so every layout (and every pipeline rank, which
holds only some of the parameters) gets the same groups in the same order. Frozen parameters
(``requires_grad=False``) get no group: no optimizer state, and no strategy communicates
their gradients. Example::

    plan = plan_groups(model, lambda name, p: {"lr": 1e-4} if "embed" in name else None,
                       no_decay="bias_and_norm")
    torch.optim.AdamW(plan.groups(model.named_parameters()), lr=1e-3, weight_decay=0.1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axon_nb.parallel.activation_checkpoint import canonical_name
from axon_nb.spec.validation import group_options_problem

Rule = Callable[[str, nn.Parameter], Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The optimizer's parameter groups, by parameter name."""

    options: tuple[dict[str, Any], ...]
    """Each group's own settings (``{}``: the optimizer's defaults), in order."""
    members: dict[str, int]
    """Group index of every trainable parameter, by its name in the user's model."""

    @property
    def plain(self) -> bool:
        """One group with no settings of its own: the optimizer takes a plain list."""
        return len(self.options) == 1 and not self.options[0]

    def names(self) -> list[list[str]]:
        """Each group's parameter names, in the model's order."""
        grouped: list[list[str]] = [[] for _ in self.options]
        for name, index in self.members.items():
            grouped[index].append(name)
        return grouped

    def groups(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """``[{"params": [...], **options}, ...]`` over ``named`` (a rank's parameters by
        name; frozen ones are left out): every group of the plan, in order, even where this
        rank holds none of its parameters (a pipeline stage), so group i is the same group on
        every rank and in every checkpoint."""
        grouped: list[dict[str, Any]] = [{"params": [], **o} for o in self.options]
        for name, param in named:
            index = self.members.get(canonical_name(name))
            if index is not None and param.requires_grad:
                grouped[index]["params"].append(param)
        return grouped

    def sets_itself(self, index: int, key: str) -> bool:
        """Whether group ``index`` chose setting ``key`` itself (``param_groups``,
        ``no_decay``) rather than taking the optimizer's."""
        return index < len(self.options) and key in self.options[index]


def plan_groups(
    model: nn.Module, rule: Rule | None = None, no_decay: str | None = None
) -> GroupPlan:
    """The groups of ``model``'s trainable parameters: ``no_decay``'s settings, then the
    ``rule``'s over them; parameters with equal settings share a group, groups in the order
    their first parameter is registered. ``ValueError`` when nothing is trainable or the rule
    gives something that is not a parameter's settings."""
    options: list[dict[str, Any]] = []
    members: dict[str, int] = {}
    without_decay = _biases_and_norms(model) if no_decay == "bias_and_norm" else set()
    for raw, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = canonical_name(raw)
        chosen: dict[str, Any] = {"weight_decay": 0.0} if name in without_decay else {}
        if rule is not None:
            problem = group_options_problem(name, rule, param)
            if problem:
                raise ValueError(problem)
            chosen.update(rule(name, param) or {})
        if chosen not in options:
            options.append(chosen)
        members[name] = options.index(chosen)
    if not members:
        raise ValueError(
            "every parameter of the model has requires_grad=False: there is nothing to train; "
            "unfreeze some (e.g. peft's get_peft_model adds trainable adapters)"
        )
    return GroupPlan(tuple(options), members)


def _biases_and_norms(model: nn.Module) -> set[str]:
    """Names of biases (a parameter named ``bias`` or ``*_bias``) and of the parameters of
    normalisation layers (a class name with ``Norm`` in it: ``LayerNorm``, ``RMSNorm``,
    ``LlamaRMSNorm``, ``GroupNorm``, ``BatchNorm2d``, ...)."""
    found = set()
    for prefix, module in model.named_modules():
        norm = "Norm" in type(module).__name__
        for leaf, _ in module.named_parameters(prefix=prefix, recurse=False):
            if norm or leaf.rpartition(".")[2].endswith("bias"):
                found.add(canonical_name(leaf))
    return found


def check_settings(plan: GroupPlan, optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when a group sets something ``optimizer`` does not take (a typo such as
    ``weight_decy`` would otherwise be carried along silently)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1's, LocalSGD's local optimizer
    known = set(inner.defaults)
    for index, settings in enumerate(plan.options):
        unknown = sorted(set(settings) - known)
        if unknown:
            example = next(n for n, i in plan.members.items() if i == index)
            raise ValueError(
                f"param_groups gave {unknown} (e.g. for {example!r}), which "
                f"{type(inner).__name__} does not take; its settings are "
                f"{', '.join(sorted(known))}"
            )


def check_built(optimizer: Any, given: list[dict[str, Any]], *, keep_groups: bool) -> None:
    """``TypeError``/``ValueError`` unless a user's ``optimizer=`` callable returned an
    optimizer over exactly the parameters it was given (``keep_groups``: in the groups it was
    given, as a sharding optimizer needs them)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer= must be a callable params -> torch.optim.Optimizer; it returned "
            f"{type(optimizer).__name__}"
        )
    held = [{id(p) for p in g["params"]} for g in optimizer.param_groups]
    wanted = [{id(p) for p in g["params"]} for g in given]
    if set().union(*held) != set().union(*wanted):
        raise ValueError(
            "the optimizer= callable must optimize exactly the parameters it is given (the "
            "trainable ones this rank holds, as the strategy laid them out); it built an "
            "optimizer over other tensors. Pass its argument on, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    if (keep_groups or len(given) > 1) and held != wanted:
        why = "param_groups= / no_decay= made" if len(given) > 1 else "ZeRO shards"
        raise ValueError(
            f"the optimizer= callable was given {len(given)} parameter group(s) ({why} them) "
            "and must keep them as they are, e.g. optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=1e-3); choose settings per parameter with "
            "param_groups=, not inside the callable"
        )
