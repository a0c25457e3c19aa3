"""Saving and loading a training run's checkpoint, on every rank (``cluster.save`` / ``load``).

A checkpoint holds the model and optimizer state keyed by parameter name (from the strategy's
``get_state``), the step count, the scheduler and grad-scaler state, and every rank's CPU
random-number state. Layout and completeness rules are in ``axon_nb.checkpoint``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from axon_nb.checkpoint.format import FULL_STATE_FILE, Checkpoint
from axon_nb.parallel.activation_checkpoint import canonical_name
from axon_nb.rank import runtime, trainstate
from axon_nb.rank.trainstate import TrainState


def save(name: str, path: str, partial: str, kind: str) -> int:
    """Write run ``name`` into ``partial``, then (rank 0) move it to ``path``; returns the step.

    Every rank must call this: the state is gathered (``full``) or written shard by shard
    (``sharded``) with collectives.
    """
    state = _run(name, "save")
    ctx = runtime.context()
    tensors = state.parallel.get_state(state.optimizer, full=kind == "full")
    rng = _gather_rng(ctx)
    if kind == "full":
        if ctx.rank == 0:
            os.makedirs(partial)
            torch.save({**tensors, "rng": rng}, os.path.join(partial, FULL_STATE_FILE))
    else:
        dcp.save({**tensors, "rng": rng}, checkpoint_id=partial)
    _barrier(ctx)  # every part is on disk before the marker says so
    if ctx.rank == 0:
        meta = Checkpoint(
            path=path,
            kind=kind,
            name=name,
            step=state.step,
            world_size=ctx.world_size,
            strategy=state.strategy.describe(),
            optimizer=_optimizer_class(state.optimizer),
            model=model_shapes(state.module),
            trainer=_trainer_state(state, bool(tensors["optimizer"].get("state"))),
        )
        _complete(meta, partial, path)
    _barrier(ctx)
    return state.step


def load(name: str, path: str) -> int:
    """Load the checkpoint at ``path`` into run ``name`` on this rank; returns its step.

    Nothing changes unless the checkpoint fits the run (same parameter names and shapes, same
    optimizer class).
    """
    ckpt = Checkpoint.read(path)
    state = _run(name, "load")
    ctx = runtime.context()
    _check_fits(ckpt, state)
    with_optimizer = ckpt.trainer["optimizer_state"]
    if ckpt.kind == "full":
        blob = torch.load(
            os.path.join(path, FULL_STATE_FILE), map_location="cpu", weights_only=True
        )
        tensors = {"model": blob["model"], "optimizer": blob["optimizer"], "rng": blob["rng"]}
    else:
        if with_optimizer:
            init_optimizer_state(state.optimizer)  # so the template has every state tensor
        # The run's own (sharded) state is the template: DCP reads into it, resharding.
        tensors = state.parallel.get_state(state.optimizer, full=False)
        tensors["rng"] = {str(r): torch.get_rng_state() for r in range(ckpt.world_size)}
        dcp.load(tensors, checkpoint_id=path)
    if not with_optimizer:
        tensors["optimizer"] = None
    state.parallel.set_state(state.optimizer, tensors)
    trainer = ckpt.trainer
    state.scheduler.load_state_dict(trainer["scheduler"])
    if state.scaler is not None and trainer["scaler"]:
        state.scaler.load_state_dict(trainer["scaler"])
    state.step = ckpt.step
    if ckpt.world_size == ctx.world_size:  # random streams belong to ranks
        torch.set_rng_state(tensors["rng"][str(ctx.rank)].cpu())
    return state.step


def model_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Shape of every state-dict entry, by the name a checkpoint uses for it."""
    return {canonical_name(key): list(value.shape) for key, value in module.state_dict().items()}


def _run(name: str, verb: str) -> TrainState:
    try:
        return trainstate.get(name)
    except KeyError:
        hint = (
            "build it first with cluster.train(model=..., strategy=..., optimizer=..., "
            f"steps=0, name={name!r}), then load"
            if verb == "load"
            else "train it first with cluster.train(..., name=...)"
        )
        raise KeyError(f"no training run named {name!r} on this rank to {verb}; {hint}") from None


def _check_fits(ckpt: Checkpoint, state: TrainState) -> None:
    ours = model_shapes(state.module)
    theirs = ckpt.model
    problems = []
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if extra:
        problems.append(f"not in this model: {_some(extra)}")
    shapes = [
        f"{k} {theirs[k]} vs {ours[k]}"
        for k in sorted(set(ours) & set(theirs))
        if theirs[k] != ours[k]
    ]
    if shapes:
        problems.append(f"different shapes (checkpoint vs model): {_some(shapes)}")
    optimizer = _optimizer_class(state.optimizer)
    if ckpt.trainer["optimizer_state"] and ckpt.optimizer != optimizer:
        problems.append(f"the checkpoint's optimizer is {ckpt.optimizer}, this run's {optimizer}")
    if problems:
        raise ValueError(
            f"the checkpoint {ckpt.path} does not fit run {state.name!r}:\n  - "
            + "\n  - ".join(problems)
            + "\nNothing was loaded; the run is unchanged. Build the run with the checkpoint's "
            "model and optimizer"
        )


def _some(items: list[str], limit: int = 5) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    return type(getattr(optimizer, "optim", optimizer)).__name__


def _trainer_state(state: TrainState, optimizer_state: bool) -> dict[str, Any]:
    return {
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict() if state.scaler is not None else {},
        "optimizer_state": optimizer_state,
    }


def _gather_rng(ctx: runtime.RankContext) -> dict[str, torch.Tensor]:
    mine = torch.get_rng_state()
    if ctx.world_size == 1:
        return {"0": mine}
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return {str(r): s for r, s in enumerate(states)}


def _barrier(ctx: runtime.RankContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def _complete(meta: Checkpoint, partial: str, path: str) -> None:
    """Mark ``partial`` complete and move it to ``path`` (replacing an older checkpoint)."""
    meta.write_marker(partial)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(partial, path)
    if old is not None:
        shutil.rmtree(old)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (moments, step counters) with one step of zero gradients
    at learning rate 0, if it has none yet; the parameters do not change. A sharded load reads
    into the run's own state, so every state tensor must exist first."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if local.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def describe(
    state: TrainState, ctx: runtime.RankContext, path: str, kind: str, tensors: dict[str, Any]
) -> Checkpoint:
    """The marker of a checkpoint of ``state`` taken now (``tensors``: what ``get_state`` gave)."""
    return Checkpoint(
        path=path,
        kind=kind,
        name=state.name,
        step=state.step,
        world_size=ctx.world_size,
        strategy=state.strategy.describe(),
        optimizer=_optimizer_class(state.optimizer),
        model=model_shapes(state.module),
        trainer=_trainer_state(state, bool(tensors["optimizer"].get("state"))),
    )


def gather_rng(ctx: runtime.RankContext) -> dict[str, torch.Tensor]:
    """Every rank's CPU random-number state, by rank (a collective)."""
    return _gather_rng(ctx)


def complete(meta: Checkpoint, partial: str, path: str) -> None:
    """(Rank 0, once every part is on disk) mark ``partial`` complete and move it to ``path``."""
    _complete(meta, partial, path)
