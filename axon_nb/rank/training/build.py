"""A fresh run built on a rank from its spec: the model (the user's, or a pretrained one on
the meta device) laid out by the strategy, its optimizer, learning-rate scheduler and grad
scaler, its data and its evaluations.

:func:`new_state` is the one place a run's scheduler and :class:`TrainState` are built: for a
fresh run here, and for a run moved to another layout (``relayout.py``). Example (what the
loop does for a fresh run)::

    state, batches, evals = fresh(spec, ctx)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from axon_nb.parallel.parallelize import ParallelModel, parallelize
from axon_nb.parallel.param_groups import GroupPlan, plan_groups
from axon_nb.rank import runtime
from axon_nb.rank.data.iterable import IterableSteps
from axon_nb.rank.data.shards import StepBatches, resolve_dataset
from axon_nb.rank.training import meta_init, trainstate
from axon_nb.rank.training.agreement import agreed
from axon_nb.rank.training.micro_step import MicroStep
from axon_nb.rank.training.optimizer_setup import grad_scaler, optimizer_factory
from axon_nb.rank.training.periodic_eval import PeriodicEval
from axon_nb.rank.training.trainstate import LRShape, TrainState
from axon_nb.spec.pretrained_model import PretrainedModel
from axon_nb.spec.train_spec import TrainSpec

Batches = StepBatches | IterableSteps
"""A run's data, step by step: map-style (``data/shards.py``) or a stream (``data/iterable.py``)."""

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""The user's ``scheduler=``: the optimizer -> its ``LRScheduler`` (checked)."""


def fresh(
    spec: TrainSpec, ctx: runtime.RankContext
) -> tuple[TrainState, Batches, PeriodicEval | None]:
    """A new run as ``spec`` says, stored under ``spec.name``: its state, its data and its
    evaluations (checked on their first batch before anything is stored). User code failing
    on some ranks only is agreed on first, so no rank is left waiting in a collective.

    Example::

        state, batches, evals = fresh(spec, runtime.context())
    """
    pretrained = spec.model if isinstance(spec.model, PretrainedModel) else None
    model, dataset, batches, groups = agreed(ctx, lambda: _model_and_data(spec, ctx))
    dims = spec.strategy.dims(ctx.world_size, ctx.local_world_size)
    parallel = parallelize(
        model.to(ctx.device) if pretrained is None else model,
        dims,
        spec.strategy.config(),
        ctx.device,
        compile=spec.compile,
        groups=groups,
        materialize=meta_init.loader(pretrained, model, ctx.device) if pretrained else None,
    )
    optimizer = parallel.build_optimizer(optimizer_factory(spec, ctx.device))
    state = new_state(
        spec,
        parallel,
        optimizer,
        scheduler=spec.scheduler,
        lr_shape=LRShape(warmup_steps=spec.warmup_steps, horizon=spec.steps, shape=spec.schedule),
        scaler=grad_scaler(ctx) if spec.mixed_precision == "fp16" else None,
        dataset=dataset,
    )
    evals = evaluations(spec, ctx, state)
    torch.manual_seed(spec.seed + 1 + ctx.rank)  # dropout and friends differ across ranks
    trainstate.put(state)
    return state, batches, evals


def _model_and_data(
    spec: TrainSpec, ctx: runtime.RankContext
) -> tuple[nn.Module, Any, Batches, GroupPlan]:
    """The user's model (not laid out yet), dataset, batches and parameter groups."""
    torch.manual_seed(spec.seed)  # the same initial parameters on every rank
    if isinstance(spec.model, PretrainedModel):  # parameters on meta: read once laid out
        model = meta_init.build(spec.model)
    elif isinstance(spec.model, nn.Module):
        model = spec.model
    else:
        model = spec.model()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module or a callable returning one; it returned "
            f"{type(model).__name__}"
        )
    groups = plan_groups(model, spec.param_groups, spec.no_decay)
    dataset = resolve_dataset(spec.data, ctx.rank)
    return model, dataset, step_batches(spec, ctx, dataset), groups


def new_state(
    spec: TrainSpec,
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: SchedulerFactory | None,
    lr_shape: LRShape,
    scaler: Any,
    dataset: Any,
    step: int = 0,
    scheduler_state: dict[str, Any] | None = None,
    layout_changes: Sequence[dict[str, Any]] = (),
) -> TrainState:
    """The run named ``spec.name`` around ``parallel`` and ``optimizer`` (not stored yet),
    with its scheduler: the user's ``scheduler`` (it must return an ``LRScheduler``), else
    the built-in ``lr_shape``. A run going on (``scheduler_state``, from a run moved to
    another layout) continues its schedule from there, the optimizer's learning rates as
    they were loaded.

    Example::

        state = new_state(spec, parallel, optimizer, scheduler=None, lr_shape=shape,
                          scaler=None, dataset=dataset)
    """
    lrs = [group["lr"] for group in optimizer.param_groups]  # (a new scheduler sets them)
    if scheduler is not None:
        built = user_scheduler(scheduler, optimizer)
    else:
        built = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_shape)
    if scheduler_state is not None:
        built.load_state_dict(scheduler_state)
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    return TrainState(
        name=spec.name,
        strategy=spec.strategy,
        parallel=parallel,
        optimizer=optimizer,
        scheduler=built,
        lr_shape=lr_shape,  # (the built-in scheduler's: a loaded state updated it in place)
        own_scheduler=scheduler is not None,
        scaler=scaler,
        dataset=dataset,
        step=step,
        layout_changes=list(layout_changes),
    )


def user_scheduler(
    scheduler: SchedulerFactory, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """``scheduler(optimizer)``, refused unless it is an ``LRScheduler``.

    Example::

        user_scheduler(lambda opt: StepLR(opt, step_size=10), optimizer)   # the StepLR
    """
    built = scheduler(optimizer)
    if not isinstance(built, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"scheduler= must return a torch.optim.lr_scheduler.LRScheduler for the "
            f"optimizer it is given, got {type(built).__name__}"
        )
    return built


def evaluations(
    spec: TrainSpec, ctx: runtime.RankContext, state: TrainState
) -> PeriodicEval | None:
    """The run's :class:`PeriodicEval` with its first batch evaluated (None without
    ``eval_data``); its data is resolved on every rank first (agreed)."""
    if spec.eval_data is None:
        return None
    autocast = MicroStep(spec, ctx, None, state.module).autocast
    last = state.step + spec.steps
    evals = agreed(ctx, lambda: PeriodicEval(spec, ctx, state, autocast, last_step=last))
    evals.check()
    return evals


def step_batches(spec: TrainSpec, ctx: runtime.RankContext, dataset: Any) -> Batches:
    """``dataset`` as this rank's batches, one step's micro-batches at a time."""
    dims = spec.strategy.dims(ctx.world_size, ctx.local_world_size)
    index, replicas = dims.data_rank(ctx.rank)
    common = dict(
        batch_size=spec.batch_size,
        grad_accum=spec.grad_accum,
        rank=index,
        world_size=replicas,
        device=ctx.device,
        loader=spec.loader,
    )
    if isinstance(dataset, IterableDataset):
        return IterableSteps(dataset, **common)
    return StepBatches(dataset, seed=spec.seed, **common)
