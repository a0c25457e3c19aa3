"""What a training run leaves on a rank between cells: model, optimizer, schedule, step count."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axon_nb.parallel import group_ledger
from axon_nb.parallel.dtensor_cache import forget_cached_meshes
from axon_nb.parallel.parallelize import ParallelModel
from axon_nb.strategies import Strategy

_STATES: dict[str, TrainState] = {}

PENDING: set[str] = set()
"""Runs a resize moved to this world and no call has laid out again yet
(``moved_run.py``): asked for by name, they say so."""

_PUBLISHED: dict[str, int] = {}
"""Run name -> ``id`` of the model :func:`publish_variable` bound to it (not the model: it
must not keep it alive)."""

_active: str | None = None
"""The run whose DTensors DTensor's dispatch caches may hold (see :func:`_activate`)."""


@dataclass(kw_only=True)
class TrainState:
    """One named run on this rank; ``cluster.train(..., resume=True)`` continues it."""

    name: str
    strategy: Strategy
    parallel: ParallelModel
    """The model as the strategy laid it out on this rank (see ``axon_nb.parallel``)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lr_shape: LRShape
    """The built-in schedule (``schedule=``, ``warmup_steps=``); unused with ``scheduler=``."""
    own_scheduler: bool = False
    """The user's ``scheduler=`` built ``scheduler``."""
    scaler: Any
    """``torch.amp.GradScaler`` for fp16, else None."""
    dataset: Any
    step: int = 0
    """Optimizer steps taken so far, over all calls."""
    layout_changes: list[dict[str, Any]] = field(default_factory=list)
    """Each move to another strategy in memory (``relayout.py``): ``step``, ``from``, ``to``,
    ``seconds``, oldest first."""

    @property
    def model(self) -> nn.Module:
        """The model as this rank trains it (e.g. wrapped in DDP)."""
        return self.parallel.model

    @property
    def module(self) -> nn.Module:
        """The user's module inside the strategy's wrapping."""
        return self.parallel.root


def get(name: str = "model") -> TrainState:
    """The training state named ``name`` on this rank.

    Example (in a ``%%axon`` cell)::

        from axon_nb.rank.training import trainstate
        trainstate.get("model").optimizer.param_groups[0]["lr"]
    """
    if name in PENDING:
        raise KeyError(
            f"the run {name!r} was moved to this world by a resize and is laid out again by "
            "its next call: cluster.train(..., resume=True, model=..., data=...) goes on with it"
        )
    if name not in _STATES:
        known = ", ".join(sorted(_STATES)) or "none yet"
        raise KeyError(
            f"no training run named {name!r} on this rank (runs: {known}); start one with "
            "cluster.train(..., resume=False). A run lives in the ranks' memory and does not "
            "survive a restart (%axon_cluster --restart, another number of ranks): moving it "
            "in memory works between strategies on the same ranks; across a restart, "
            "cluster.save(path) before it and cluster.load(path) after (resharded on load)"
        )
    _activate(name)
    return _STATES[name]


def _activate(name: str | None) -> None:
    """Empty DTensor's dispatch caches when another run becomes the one in use: they would
    hand its operations the mesh of the run used before (``parallel/dtensor_cache.py``),
    whose groups may be destroyed by then."""
    global _active
    if name != _active:
        forget_cached_meshes()
        _active = name


def runs() -> dict[str, TrainState]:
    """Every training run on this rank, by name."""
    return dict(_STATES)


def put(state: TrainState) -> None:
    """Keep ``state`` under its name (a run of that name before it is let go, and its
    ``%%axon`` variable with it: that model would keep its destroyed groups, and their
    threads, alive through the collection that frees them)."""
    if _STATES.get(state.name, state) is not state:  # (no local: it would keep it alive)
        forget_variable(_STATES[state.name])
    _STATES[state.name] = state
    _release_groups()
    _activate(state.name)


def publish_variable(state: TrainState) -> None:
    """Bind the run's model to its name in the rank's namespace, so the next ``%%axon``
    cell can evaluate it (a rank's ``train`` does, after each call)."""
    shell = _shell()
    if shell is not None:
        shell.user_ns[state.name] = state.model
        _PUBLISHED[state.name] = id(state.model)


def forget_variable(state: TrainState) -> None:
    """Remove the variable :func:`publish_variable` bound for ``state``, while it still
    names this state's model (a user's own variable of that name is left alone: in the
    kernel, ``train_local``'s model is the user's object)."""
    shell = _shell()
    model = state.parallel.model if state.parallel is not None else None
    if shell is None or model is None or _PUBLISHED.get(state.name) != id(model):
        return
    if shell.user_ns.get(state.name) is model:
        del shell.user_ns[state.name]
    del _PUBLISHED[state.name]


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def drop(name: str) -> None:
    """Forget the run ``name`` (its model, optimizer and data go with it); no error if absent."""
    _STATES.pop(name, None)
    _PUBLISHED.pop(name, None)
    shell = _shell()
    if shell is not None:
        shell.user_ns.pop(name, None)
    _release_groups()


def _release_groups() -> None:
    """Destroy the process groups of layouts no kept run uses (replaced, dropped, or built
    by a run that failed): idle gloo groups still cost threads and CPU."""
    held = [s.parallel.dims for s in _STATES.values() if s.parallel is not None]
    if group_ledger.release_unheld(held):  # (a failing destroy is warned about, not raised)
        forget_world()  # (the caches may hold the destroyed groups' meshes)
        group_ledger.collect_lingering()


def forget_world() -> None:
    """Empty DTensor's caches and forget which run was in use: groups were destroyed, or
    the world was re-formed (group names start again)."""
    global _active
    forget_cached_meshes()
    _active = None


@dataclass(kw_only=True)
class LRShape:
    """Learning-rate factor per step: linear warm-up, then constant, linear or cosine to 0."""

    warmup_steps: int
    horizon: int
    """Step at which a decaying schedule reaches 0 (the end of the current call)."""
    shape: str = "constant"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.shape == "constant":
            return 1.0
        span = max(1, self.horizon - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.shape == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
