"""Which modules of a model hold experts, for expert parallelism (``axon_nb.parallel.expert``).

An experts module is one that stacks its experts' weights: it has an integer ``num_experts``
and parameters of shape ``[num_experts, ...]``, and it is called as
``experts(tokens, top_k_index, top_k_weights)`` (``axon_nb.models.moe.GroupedExperts``,
transformers' ``MixtralExperts``, ``Qwen2MoeExperts`` ...).

A plan names them: ``None`` takes the model's own (a transformers model's
``config.base_model_ep_plan`` entries marked ``"ep_dispatch_experts"``, else every module that
looks like the above); a tuple of ``fnmatch`` patterns names them directly. Before a run
starts, the kernel has rank 0 check a meta-device copy of the model (``factory_problem``), so
a bad layout is refused before anything is built.

Example::

    expert_modules(model, None, ep=2)                          # {"blocks.0.mlp.experts": ...}
    expert_modules(model, ("model.layers.*.mlp.experts",), ep=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from axon_nb.parallel.module_patterns import matching

DISPATCH_STYLE = "ep_dispatch_experts"
"""The style transformers' ``base_model_ep_plan`` gives the modules whose tokens are dispatched."""


def expert_modules(model: nn.Module, plan: Sequence[str] | None, ep: int) -> dict[str, nn.Module]:
    """The experts modules ``plan`` names in ``model``, by name; ``ValueError`` when it names
    none, names something that is not an experts module, or ``ep`` does not divide one's
    experts."""
    modules = dict(model.named_modules())
    if plan is None:
        patterns = _model_plan(model)
        if patterns is None:
            found = {n: m for n, m in modules.items() if stacked_experts(m)}
            if not found:
                raise ValueError(
                    f"expert parallelism needs a mixture-of-experts model, but "
                    f"{type(model).__name__} has no experts module (a module with num_experts "
                    "and [num_experts, ...] weights, such as GPTConfig(experts=8)'s "
                    "GroupedExperts). Use another strategy, or name the experts with plan=("
                    "'<module name pattern>',)"
                )
            return _checked(found, ep)
    else:
        patterns = list(plan)
    found, problems = {}, []
    for pattern in patterns:
        names, problem = matching(modules, pattern)
        if problem:
            problems.append(problem)
        for name in names:
            if not stacked_experts(modules[name]):
                problems.append(
                    f"{name!r} ({type(modules[name]).__name__}) is not an experts module: it "
                    "needs an integer num_experts and weights of shape [num_experts, ...]"
                )
            found[name] = modules[name]
    if problems:
        raise ValueError(
            "the expert-parallel plan does not fit the model:\n  - " + "\n  - ".join(problems)
        )
    return _checked(found, ep)


def factory_problem(factory: Any, plan: Sequence[str] | None, ep: int) -> str | None:
    """What :func:`expert_modules` refuses about the model ``factory`` builds, built on the
    meta device (no memory, no weights); None when it fits, or when the factory cannot build
    on the meta device (it loads files, say: the run then checks the real model)."""
    import torch

    try:
        with torch.device("meta"):
            model = factory()
    except Exception:
        return None
    if not isinstance(model, nn.Module):
        return None
    try:
        expert_modules(model, plan, ep)
    except ValueError as e:
        return str(e)
    return None


def stacked_experts(module: nn.Module) -> bool:
    """``module`` keeps its experts as ``[num_experts, ...]`` parameters of its own."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or count < 1:
        return False
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() >= 2 and p.shape[0] == count for p in own)


def _checked(found: dict[str, nn.Module], ep: int) -> dict[str, nn.Module]:
    sizes = {n: int(getattr(m, "num_experts", 0)) for n, m in found.items()}  # (stacked)
    uneven = {n: size for n, size in sizes.items() if size % ep}
    if uneven:
        counts = sorted(set(uneven.values()))
        raise ValueError(
            f"ep={ep} does not divide the number of experts ({', '.join(map(str, counts))} in "
            f"{', '.join(uneven)}): every rank keeps the same number of experts. Choose ep "
            f"among {', '.join(str(d) for d in range(1, counts[0] + 1) if counts[0] % d == 0)}"
        )
    return found


def _model_plan(model: nn.Module) -> list[str] | None:
    """The patterns of a transformers model's ``base_model_ep_plan`` that dispatch tokens,
    under its ``base_model_prefix``; None when it has no plan."""
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else model
    base = getattr(getattr(inner, "config", None), "base_model_ep_plan", None)
    if not base:
        return None
    prefix = getattr(inner, "base_model_prefix", "")
    lead = f"{prefix}." if prefix and hasattr(inner, prefix) else ""
    if inner is not model:  # a PEFT wrapper: its module names lead to the inner model
        lead = next(n for n, m in model.named_modules() if m is inner) + "." + lead
    return [lead + k for k, style in base.items() if style == DISPATCH_STYLE]
