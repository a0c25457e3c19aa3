"""``resume=True``: a stored run goes on with this call's data, settings and strategy.

What a resumed call may change, and what it keeps:

- the data (``data=None`` keeps the run's) and the evaluations;
- the optimizer's existing settings (``optimizer=(name, {...})``), except in a parameter
  group that set them itself (``param_groups=``, ``no_decay=``); the groups themselves stay;
- the built-in schedule (``schedule=``, ``warmup_steps=``), counted from the run's start; a
  run with its own ``scheduler=`` keeps it and its learning rate;
- the strategy: the run moves to it in memory (``relayout.py``);
- the world size, after ``cluster.resize``: the run is laid out again (``moved_run.py``).

Example (what the loop does for ``resume=True``)::

    state, batches, evals = resume(spec, ctx)
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import IterableDataset

from axon_nb.parallel.param_groups import GroupPlan, plan_groups
from axon_nb.rank import runtime
from axon_nb.rank.data.shards import resolve_dataset
from axon_nb.rank.training import moved_run, trainstate
from axon_nb.rank.training.build import Batches, evaluations, step_batches
from axon_nb.rank.training.periodic_eval import PeriodicEval
from axon_nb.rank.training.relayout import relayout
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.train_spec import TrainSpec


def resume(
    spec: TrainSpec, ctx: runtime.RankContext
) -> tuple[TrainState, Batches, PeriodicEval | None]:
    """The stored run ``spec.name`` set up to go on as ``spec`` says: its state, this call's
    data and evaluations. Every input is checked before the stored state changes.

    Example::

        state, batches, evals = resume(spec, runtime.context())
    """
    moved = moved_run.pending(spec.name)
    if moved:  # a resize moved it to this world: laid out again
        moved_run.rebuild(spec, ctx)
    state = trainstate.get(spec.name)
    if spec.data is None and state.dataset is None:
        raise ValueError(
            f"{spec.name!r} was moved to this world by a resize and has no data on the new "
            "ranks: pass data= again with resume=True"
        )
    dataset = state.dataset if spec.data is None else resolve_dataset(spec.data, ctx.rank)
    if moved and isinstance(dataset, IterableDataset) and ctx.rank == 0:
        print(
            f"{spec.name!r} reads a stream, which a resize cannot keep in order: each rank "
            "reads its stream afresh, so the run differs from one never resized",
            file=sys.stderr,
        )
    batches = step_batches(spec, ctx, dataset)
    plan = state.parallel.groups
    changes = spec.optimizer_kwargs
    _check_changes(spec, state, changes)
    if spec.strategy != state.strategy:  # moved in memory; unchanged if that fails
        state = relayout(spec, ctx, state)
    evals = evaluations(spec, ctx, state)
    # Only now, with every input checked, does the stored state change.
    state.dataset = dataset
    _apply_changes(spec, state, changes, plan)
    return state, batches, evals


def _check_changes(spec: TrainSpec, state: TrainState, changes: dict[str, Any]) -> None:
    """Refuse what a resumed call cannot change: the parameter groups, optimizer settings
    the optimizer does not have, the learning rate of a run with its own scheduler."""
    if spec.param_groups is not None or spec.no_decay is not None:
        _check_same_groups(spec, state)
    unknown = [k for k in changes if k not in state.optimizer.param_groups[0]]
    if unknown:
        raise ValueError(
            f"resume=True keeps the optimizer and can only change its existing settings "
            f"({', '.join(sorted(state.optimizer.param_groups[0]))}); unknown: {unknown}"
        )
    if state.own_scheduler and "lr" in changes:
        raise ValueError(
            f"{spec.name!r} runs with its own scheduler=, which sets the learning rate; resume "
            "without optimizer lr (other settings may change), or train afresh"
        )


def _apply_changes(
    spec: TrainSpec, state: TrainState, changes: dict[str, Any], plan: GroupPlan
) -> None:
    """This call's optimizer settings and built-in schedule, applied to the stored run
    (``plan``: its parameter groups)."""
    # a group keeps what it chose itself (param_groups=, no_decay=): e.g. its own lr
    for index, group in enumerate(state.optimizer.param_groups):
        group.update({k: v for k, v in changes.items() if not plan.sets_itself(index, k)})
    if state.own_scheduler:  # its own schedule goes on where it was
        return
    if "lr" in changes:
        state.scheduler.base_lrs = [
            base if plan.sets_itself(index, "lr") else changes["lr"]
            for index, base in enumerate(state.scheduler.base_lrs)
        ]
    # Steps count from the run's start, so resuming with the same arguments after a stop
    # continues the schedule exactly; training past the old end stretches the decay.
    state.lr_shape.warmup_steps = spec.warmup_steps
    state.lr_shape.shape = spec.schedule
    state.lr_shape.horizon = max(state.lr_shape.horizon, state.step + spec.steps)
    factor = state.lr_shape(state.step)
    for group, base in zip(state.optimizer.param_groups, state.scheduler.base_lrs, strict=True):
        group["lr"] = base * factor


def _check_same_groups(spec: TrainSpec, state: TrainState) -> None:
    """A resumed run keeps its optimizer's groups: ``param_groups``/``no_decay`` given again
    must make the same ones."""
    again = plan_groups(state.module, spec.param_groups, spec.no_decay)
    if again != state.parallel.groups:
        raise ValueError(
            f"resume=True keeps the parameter groups {spec.name!r} trains with; these "
            f"param_groups=/no_decay= group its parameters differently ({again.options} "
            f"against {state.parallel.groups.options}). Leave them out to keep the run's, "
            "or train afresh (resume=False)"
        )
