"""A run carried across a resize of the cluster, in memory (``cluster.resize``).

Before the old world is left, rank 0 gathers the run's whole state (model and optimizer,
keyed by parameter name, on its CPU) with what the run needs to go on (step, schedule,
scaler, parameter groups, optimizer class, strategy) and keeps it packed (:func:`pack`);
every other rank drops its part. Once the new world is joined, every rank knows the run is
pending (:func:`hold`), and the run's next call (``train(resume=True)``, which a resize during
a run makes itself) rebuilds it (:func:`rebuild`): rank 0 broadcasts the packed state, and
every rank lays out a fresh model under the call's strategy for the new world size and loads
it, as a strategy switch does (``relayout.build_layout``). Until then, rank 0 holds the one
copy. Example (what ``resume`` does)::

    if moved_run.pending(spec.name):
        moved_run.rebuild(spec, ctx)       # now trainstate.get(spec.name) works
"""

from __future__ import annotations

import time
from copy import deepcopy
from typing import Any

import cloudpickle
from torch import nn

from axon_nb.parallel.strategy_state import kept_by
from axon_nb.rank import runtime
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.build import new_state
from axon_nb.rank.training.optimizer_setup import grad_scaler
from axon_nb.rank.training.relayout import build_layout, optimizer_class
from axon_nb.spec.train_spec import TrainSpec

_MOVED: dict[str, bytes | None] = {}
"""Runs waiting for their next call in the new world: rank 0 holds each one's packed state,
the other ranks None."""


def pack(name: str) -> bool:
    """(Every rank of the old world; a collective) Keep the run ``name`` packed on rank 0;
    whether this rank holds it. Its layout stays until the caller drops it."""
    state = trainstate.get(name)
    if kept_by(state.optimizer) is not None:
        raise ValueError(
            f"{name!r} trains with {state.strategy.describe()}, whose own state (an outer loop, "
            "gradients in flight) a resize does not carry: save a checkpoint, resize, load it"
        )
    full = state.parallel.get_state(state.optimizer, full=True)  # (rank 0's is complete)
    ctx = runtime.context()
    if ctx.rank != 0:
        return False
    _MOVED[name] = cloudpickle.dumps({
        "full": full,
        "strategy": state.strategy,
        "world_size": ctx.world_size,
        "groups": state.parallel.groups,
        "optimizer_class": optimizer_class(state.optimizer),
        "scheduler_state": state.scheduler.state_dict(),
        "own_scheduler": state.own_scheduler,
        "lr_shape": state.lr_shape,
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "step": state.step,
        "layout_changes": state.layout_changes,
    })  # fmt: skip
    return True


def hold(name: str) -> None:
    """(Every rank of the new world) ``name`` is pending here until its next call."""
    _MOVED.setdefault(name, None)
    trainstate.PENDING.add(name)


def pending(name: str) -> bool:
    """Whether the run ``name`` was moved by a resize and not yet rebuilt."""
    return name in _MOVED


def holds(name: str | None) -> bool:
    """Whether this rank holds the packed state of the pending run ``name``."""
    return _MOVED.get(name or "") is not None


def forget_all_but(keep: str | None) -> list[str]:
    """Drop every pending run but ``keep``; their names."""
    names = [name for name in _MOVED if name != keep]
    for name in names:
        del _MOVED[name]
        trainstate.PENDING.discard(name)
    return names


def forget(name: str) -> None:
    """Drop a pending run (a fresh run of that name replaces it)."""
    _MOVED.pop(name, None)
    trainstate.PENDING.discard(name)


def rebuild(spec: TrainSpec, ctx: runtime.RankContext) -> trainstate.TrainState:
    """(Every rank; a collective) The run ``spec.name`` laid out under ``spec.strategy`` on
    this world from the packed state, and stored. Its data comes with the call."""
    started = time.perf_counter()
    moved = cloudpickle.loads(_from_rank_0(_MOVED.get(spec.name), ctx))
    if moved["own_scheduler"] and spec.scheduler is None:
        raise ValueError(
            f"{spec.name!r} runs with its own scheduler=, which must be built again for the "
            "resized world's optimizer: pass the same scheduler= with resume=True"
        )
    if spec.model is None:
        raise ValueError(
            f"{spec.name!r} was moved to a world of {ctx.world_size} ranks by a resize and is laid "
            "out again by its next call: pass the model again with resume=True "
            "(model=make_model, the same architecture); its weights and optimizer state come "
            "from the run"
        )
    model = deepcopy(spec.model) if isinstance(spec.model, nn.Module) else spec.model()
    parallel, optimizer = build_layout(
        spec.strategy, model, moved["full"], moved["optimizer_class"], moved["groups"], ctx, spec
    )
    change = {
        "step": moved["step"],
        "from": f"{moved['strategy'].describe()} · {moved['world_size']} ranks",
        "to": f"{spec.strategy.describe()} · {ctx.world_size} ranks",
        "seconds": time.perf_counter() - started,
        "world_size": [moved["world_size"], ctx.world_size],
    }
    scaler = None
    if moved["scaler"] is not None:  # (its tensors on this rank's device, not rank 0's)
        scaler = grad_scaler(ctx)
        scaler.load_state_dict(moved["scaler"])
    state = new_state(
        spec, parallel, optimizer,
        scheduler=spec.scheduler if moved["own_scheduler"] else None,
        lr_shape=moved["lr_shape"], scaler=scaler, dataset=None, step=moved["step"],
        scheduler_state=moved["scheduler_state"],
        layout_changes=[*moved["layout_changes"], change],
    )  # fmt: skip
    trainstate.put(state)
    _MOVED.pop(spec.name, None)
    trainstate.PENDING.discard(spec.name)
    return state


def _from_rank_0(payload: bytes | None, ctx: runtime.RankContext) -> bytes:
    """Rank 0's ``payload`` on every rank, over the CPU: on GPU ranks through a gloo group
    made for it (NCCL would stage the whole state on every GPU at once)."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo") if ctx.device.type == "cuda" else None
    try:
        holder: list[Any] = [payload if ctx.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=group)
        return holder[0]  # (bytes, as rank 0 packed them)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
