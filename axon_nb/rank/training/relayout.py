"""A run moved to another strategy on the same ranks, in memory (``resume=True`` with a new
``strategy=``): model, optimizer state, step, learning-rate schedule and data position.

1. Every rank gathers the run's whole state, keyed by parameter name, onto its CPU
   (``ParallelModel.get_state(full=True, every_rank=True)``): the one extra copy.
2. The old layout is let go (its model, optimizer and the ranks' ``%%axon`` variable), so at
   most the old layout and that copy, then that copy and the new layout, are alive at once.
3. A fresh model (this call's ``model=``, the same architecture) is laid out under the new
   strategy with the run's parameter groups, the optimizer is rebuilt (its class; settings
   come with its state), the state is loaded, and the scheduler and grad scaler continue.

If laying out the new strategy fails (a pipeline cut the model cannot take, a plan that names
nothing), the old layout is rebuilt from the copy the same way and the error raised: the run
stays usable as it was. A run with its own ``scheduler=`` needs it again, and what it returns
must be an ``LRScheduler`` (as for a fresh run, ``build.new_state``): that is checked on the
old optimizer before anything is let go. Example (what the loop does)::

    state = relayout(spec, ctx, state)   # now under spec.strategy, same step
"""

from __future__ import annotations

import dataclasses
import time
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from axon_nb.parallel.parallelize import OptimizerFactory, ParallelModel, parallelize
from axon_nb.parallel.param_groups import GroupPlan
from axon_nb.rank import runtime
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.build import SchedulerFactory, new_state, user_scheduler
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.train_spec import TrainSpec
from axon_nb.strategies import Strategy

Layout = tuple[ParallelModel, torch.optim.Optimizer]
"""A model laid out by a strategy, and its optimizer."""


def copy_run(spec: TrainSpec, ctx: runtime.RankContext, source: TrainState) -> TrainState:
    """A new run named ``spec.name`` under ``spec.strategy`` with ``source``'s state (model,
    optimizer, step, schedule); ``source`` stays as it is (``compare(from_state=True)``)."""
    make = _model_source(spec, source)
    scheduler = _scheduler_source(spec, source)
    full = source.parallel.get_state(source.optimizer, full=True, every_rank=True)
    full = _copied(full)  # (on CPU ranks it may share storage with the source's tensors)
    optimizer_cls = optimizer_class(source.optimizer)
    new = build_layout(
        spec.strategy, make(), full, optimizer_cls, source.parallel.groups, ctx, spec
    )
    return _state(spec, source, new, source.scheduler.state_dict(), scheduler, change=None)


def relayout(spec: TrainSpec, ctx: runtime.RankContext, state: TrainState) -> TrainState:
    """``state``'s run under ``spec.strategy`` (every rank calls it); the old one is gone."""
    started = time.perf_counter()
    make = _model_source(spec, state)
    scheduler = _scheduler_source(spec, state)
    if scheduler is not None:  # refused while the run can still go on as it was
        _try_scheduler(scheduler, state.optimizer)
    full = state.parallel.get_state(state.optimizer, full=True, every_rank=True)
    optimizer_cls = optimizer_class(state.optimizer)
    scheduler_state = state.scheduler.state_dict()
    groups, old = state.parallel.groups, state.strategy
    _let_go(state)
    try:
        new = build_layout(spec.strategy, make(), full, optimizer_cls, groups, ctx, spec)
    except Exception:  # the run as it was, from the copy
        back = build_layout(old, make(), full, optimizer_cls, groups, ctx, spec)
        as_before = dataclasses.replace(spec, strategy=old, name=state.name)
        _state(as_before, state, back, scheduler_state, scheduler, change=None)
        raise
    change = {
        "step": state.step,
        "from": old.describe(),
        "to": spec.strategy.describe(),
        "seconds": time.perf_counter() - started,
    }
    return _state(spec, state, new, scheduler_state, scheduler, change=change)


def _state(
    spec: TrainSpec,
    old: TrainState,
    new: Layout,
    scheduler_state: dict[str, Any],
    scheduler: SchedulerFactory | None,
    change: dict[str, Any] | None,
) -> TrainState:
    """The run named ``spec.name`` in its new layout, stored: ``old``'s schedule, scaler, data
    and step around the new model and optimizer."""
    parallel, optimizer = new
    state = new_state(
        spec,
        parallel,
        optimizer,
        scheduler=scheduler,
        lr_shape=deepcopy(old.lr_shape),
        scaler=deepcopy(old.scaler),
        dataset=old.dataset,
        step=old.step,
        scheduler_state=scheduler_state,
        layout_changes=[*old.layout_changes, *([change] if change else [])],
    )
    trainstate.put(state)
    return state


def _scheduler_source(spec: TrainSpec, state: TrainState) -> SchedulerFactory | None:
    """What builds the schedule for the new layout's optimizer: this call's ``scheduler=``
    for a run with its own (required), else None (the built-in one goes on)."""
    if not state.own_scheduler:
        return None
    if spec.scheduler is None:
        raise ValueError(
            f"{state.name!r} runs with its own scheduler=, which must be built again for the "
            "new layout's optimizer: pass the same scheduler= with resume=True"
        )
    return spec.scheduler


def _try_scheduler(scheduler: SchedulerFactory, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a ``scheduler=`` that does not return an ``LRScheduler`` before the old layout
    is let go: it is built once on the old optimizer and dropped, and the settings it set
    there (learning rates, a cycle's momentum) are put back."""
    saved = [_copied({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
    try:
        user_scheduler(scheduler, optimizer)
    finally:
        for group, settings in zip(optimizer.param_groups, saved, strict=True):
            for key in [k for k in group if k != "params" and k not in settings]:
                del group[key]
            for key, value in settings.items():
                if isinstance(value, torch.Tensor) and isinstance(group[key], torch.Tensor):
                    group[key].copy_(value)  # (a scheduler sets a tensor lr in place)
                else:
                    group[key] = value


def optimizer_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class under ``optimizer`` (a ZeRO wrapper keeps it as ``optim``)."""
    inner: torch.optim.Optimizer = getattr(optimizer, "optim", optimizer)
    return type(inner)


def _copied(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copied(v) for v in state]
    return state


def _model_source(spec: TrainSpec, state: TrainState) -> Any:
    """What builds the model to lay out again: this call's ``model=``. (The old module itself
    is never reused: a strategy may have sharded, cut or hooked it.)"""
    if spec.model is None:
        raise ValueError(
            f"moving {state.name!r} from {state.strategy.describe()} to "
            f"{spec.strategy.describe()} lays out a fresh copy of the model: pass the model "
            "again with resume=True (model=make_model, the same architecture); its weights "
            "and optimizer state come from the run"
        )
    if isinstance(spec.model, nn.Module):
        return lambda: deepcopy(spec.model)
    return spec.model


def _let_go(state: TrainState) -> None:
    """Drop this rank's references to the old layout (the ``%%axon`` variable too)."""
    trainstate.forget_variable(state)
    # emptied, not typed as optional: a stored run always has them (the scheduler holds the
    # optimizer); a failed move stores the rebuilt old layout in a new state
    state.parallel = state.optimizer = state.scheduler = None  # type: ignore[assignment]  # let go


def build_layout(
    strategy: Strategy,
    model: nn.Module,
    full: dict[str, Any],
    optimizer_cls: type[torch.optim.Optimizer],
    groups: GroupPlan,
    ctx: runtime.RankContext,
    spec: TrainSpec,
) -> Layout:
    """``model`` laid out by ``strategy`` with ``full`` loaded: (parallel, optimizer)."""
    dims = strategy.dims(ctx.world_size, ctx.local_world_size)
    parallel = parallelize(
        model.to(ctx.device), dims, strategy.config(), ctx.device, compile=spec.compile,
        groups=groups,
    )  # fmt: skip
    optimizer = parallel.build_optimizer(OptimizerFactory(optimizer_cls, {}))
    for group in optimizer.param_groups:  # as a scheduler left them: the state has it too
        group.setdefault("initial_lr", group["lr"])
    parallel.set_state(optimizer, _containers(full))  # (loading may rewrite its dicts)
    return parallel, optimizer


def _containers(state: Any) -> Any:
    """``state``'s dicts and lists copied, its tensors shared: what a load may rewrite (a
    full state dict's entries replaced by their shards) is then a copy, and a failed move can
    still rebuild the old layout from ``state``."""
    if isinstance(state, dict):
        return {k: _containers(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_containers(v) for v in state]
    return state
