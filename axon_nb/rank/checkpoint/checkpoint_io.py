"""Saving and loading a training run's checkpoint, on every rank (``cluster.save`` / ``load``).

A checkpoint holds the model and optimizer state keyed by parameter name (from the strategy's
``get_state``), the step count, the scheduler and grad-scaler state, and every rank's CPU
random-number state. Layout and completeness rules are in ``axon_nb.checkpoint``.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.parallel.activation_checkpoint import canonical_name
from axon_nb.parallel.optim_state import SAME_GROUPS, groups_problem, init_optimizer_state
from axon_nb.parallel.strategy_state import is_local, kept_by
from axon_nb.rank import runtime
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.checkpoint_format import (
    FULL_STATE_FILE,
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    Checkpoint,
    SaveTarget,
    fingerprint,
)


def save(name: str, target: SaveTarget) -> int:
    """Write run ``name`` into ``target.partial``, then (rank 0) move it to ``target.path``;
    returns the step.

    Every rank must call this: the state is gathered (``full``) or written shard by shard
    (``sharded``) with collectives. A failure on any rank fails the save on every rank.
    """
    state = run_named(name, "save")
    ctx = runtime.context()
    tensors = state.parallel.get_state(state.optimizer, full=target.kind == "full")
    kept = strategy_tensors(state)
    if kept is not None:
        tensors["strategy"] = _gathered(kept, ctx) if target.kind == "full" else kept
    rng = _gather_rng(ctx)
    error = None
    if target.kind == "full":
        if ctx.rank == 0:
            try:
                write_full({**tensors, "rng": rng}, target.partial)
            except Exception as e:
                error = e
    else:
        import torch.distributed.checkpoint as dcp  # (1 s of CPU: only where it is used)

        dcp.save({**tensors, "rng": rng}, checkpoint_id=target.partial)  # fails on all ranks
    agree(ctx, error, "write the checkpoint")  # every part is on disk before the marker
    if ctx.rank == 0:
        meta = describe(state, ctx, target.path, target.kind, tensors)
        try:
            _complete(meta, target)
        except Exception as e:
            error = e
    agree(ctx, error, "complete the checkpoint")
    return state.step


def load(name: str, path: str) -> int:
    """Load the checkpoint at ``path`` into run ``name`` on this rank; returns its step.

    Nothing changes unless the checkpoint fits the run (same parameter names and shapes, same
    optimizer class). Nothing in it is executed: ``state.pt`` is read with
    ``weights_only=True``, a sharded checkpoint through :class:`SafeReader`.
    """
    import torch.distributed.checkpoint as dcp  # (1 s of CPU: only where it is used)

    from axon_nb.rank.checkpoint.safe_reader import SafeReader

    ckpt = Checkpoint.read(path)
    state = run_named(name, "load")
    ctx = runtime.context()
    _check_fits(ckpt, state)
    if ckpt.kind == "sharded":
        SafeReader(path).check()  # refuse what would run code before anything changes
    with_optimizer = ckpt.trainer["optimizer_state"]
    if with_optimizer:
        init_optimizer_state(state.optimizer)  # so the template has every state tensor
    keeper = kept_by(state.optimizer)  # (its state loads from a checkpoint of its own kind)
    if keeper is not None and ckpt.trainer.get("strategy_state") != keeper.state_kind:
        keeper = None
    if ckpt.kind == "full":
        blob = torch.load(
            os.path.join(path, FULL_STATE_FILE), map_location="cpu", weights_only=True
        )
        tensors = {"model": blob["model"], "optimizer": blob["optimizer"], "rng": blob["rng"]}
        tensors["strategy"] = blob.get("strategy")
        keeper = keeper if tensors["strategy"] is not None else None
        if ckpt.world_size != ctx.world_size and keeper is not None:  # (no rank's own)
            tensors["strategy"] = {k: v for k, v in tensors["strategy"].items()
                                   if not is_local(k)}  # fmt: skip
    else:
        # The run's own (sharded) state is the template: DCP reads into it, resharding.
        tensors = state.parallel.get_state(state.optimizer, full=False)
        tensors["rng"] = {str(r): torch.get_rng_state() for r in range(ckpt.world_size)}
        if keeper is not None:  # (each rank's own parts only on as many ranks as then)
            same_world = ckpt.world_size == ctx.world_size
            template = keeper.strategy_state(parameter_names(state), local=same_world)
            # (copies: loading the model and the optimizer below may rewrite what it points at)
            tensors["strategy"] = {k: v.detach().clone() for k, v in template.items()}
        dcp.load(tensors, storage_reader=SafeReader(path))
    if not with_optimizer:
        tensors["optimizer"] = None
    state.parallel.set_state(state.optimizer, tensors)
    if keeper is not None:  # (after the optimizer's own state, which restarts it)
        keeper.load_strategy_state(tensors["strategy"], parameter_names(state))
    trainer = ckpt.trainer
    state.scheduler.load_state_dict(trainer["scheduler"])
    if state.scaler is not None and trainer["scaler"]:
        state.scaler.load_state_dict(trainer["scaler"])
    state.step = ckpt.step
    mine = tensors["rng"].get(str(ctx.rank))  # (a rescue has no stream for the dead ranks)
    if ckpt.world_size == ctx.world_size and mine is not None:  # streams belong to ranks
        torch.set_rng_state(mine.cpu())
    return state.step


def _gathered(kept: dict[str, Any], ctx: runtime.RankContext) -> dict[str, Any]:
    """A strategy's state for a full checkpoint (every rank calls it: collectives): sharded
    parts whole, and every rank's own parts (``local<rank>/...``) on every rank."""
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in kept.items()}
    own = {k: v.cpu() for k, v in whole.items() if is_local(k)}
    if ctx.world_size > 1 and own:
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, own)
        own = {k: v for ranks in everyone for k, v in ranks.items()}
    return {**{k: v for k, v in whole.items() if not is_local(k)}, **own}


def strategy_tensors(state: TrainState) -> dict[str, Any] | None:
    """What the run's strategy keeps of its own for a checkpoint (DiLoCo's outer loop,
    AsyncSGD's gradients in flight: ``parallel/strategy_state.py``), or None."""
    keeper = kept_by(state.optimizer)
    return keeper.strategy_state(parameter_names(state)) if keeper is not None else None


def parameter_names(state: TrainState) -> dict[int, str]:
    """Each parameter's name in checkpoints, by the parameter's id."""
    return {id(p): canonical_name(n) for n, p in state.parallel.root.named_parameters()}


def model_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Shape of every state-dict entry, by the name a checkpoint uses for it."""
    return {canonical_name(key): list(value.shape) for key, value in module.state_dict().items()}


def run_named(name: str, verb: str) -> TrainState:
    """Run ``name`` on this rank, or a KeyError saying how to make one to ``verb``."""
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
    optimizer = optimizer_class(state.optimizer)
    if ckpt.trainer["optimizer_state"] and ckpt.optimizer != optimizer:
        problems.append(f"the checkpoint's optimizer is {ckpt.optimizer}, this run's {optimizer}")
    saved, groups = ckpt.trainer.get("param_groups"), group_names(state)
    grouping = groups_problem(saved, groups, some=False) if saved and groups else None
    if grouping:  # (checkpoints before groups were recorded, or a callable's own, are not)
        problems.append(
            f"the checkpoint's optimizer groups parameters differently ({grouping}): {SAME_GROUPS}"
        )
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


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The user's optimizer class name (``AdamW``), also inside ZeroRedundancyOptimizer."""
    return type(getattr(optimizer, "optim", optimizer)).__name__


def trainer_state(
    state: TrainState, optimizer_state: bool, *, strategy_state: bool = True
) -> dict[str, Any]:
    """The marker's ``trainer`` entry: scheduler and scaler state, whether the checkpoint
    holds optimizer state, and the kind of the strategy's own state it holds (or None: also
    when ``strategy_state`` is False)."""
    keeper = kept_by(state.optimizer) if strategy_state else None
    return {
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict() if state.scaler is not None else {},
        "optimizer_state": optimizer_state,
        "param_groups": group_names(state),
        "strategy_state": keeper.state_kind if keeper is not None else None,
    }


def group_names(state: TrainState) -> list[list[str]] | None:
    """The names of each optimizer parameter group's parameters (the run's groups, over all
    ranks); None where a user's ``optimizer=`` callable grouped them itself."""
    plan = state.parallel.groups
    return plan.names() if len(state.optimizer.param_groups) == len(plan.options) else None


def _gather_rng(ctx: runtime.RankContext) -> dict[str, torch.Tensor]:
    mine = torch.get_rng_state()
    if ctx.world_size == 1:
        return {"0": mine}
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return {str(r): s for r, s in enumerate(states)}


def agree(ctx: runtime.RankContext, error: Exception | None, what: str) -> None:
    """A barrier at which every rank learns whether any failed: then every rank raises (a rank
    its own error, the others one naming the first failed rank), or all go on."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    texts: list[Any] = [mine]
    if ctx.world_size > 1:
        texts = [None] * ctx.world_size
        dist.all_gather_object(texts, mine)
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
    if failed:
        rank, text = failed[0]
        raise RuntimeError(f"rank {rank} could not {what}: {text}")


def write_full(state: dict[str, Any], partial: str) -> None:
    """Write a full checkpoint's ``state.pt`` into ``partial`` and flush it to disk."""
    os.makedirs(partial, exist_ok=True)  # the kernel created it; a direct call may not have
    file = os.path.join(partial, FULL_STATE_FILE)
    torch.save(state, file)
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


def _complete(meta: Checkpoint, target: SaveTarget) -> None:
    """Mark ``target.partial`` complete and move it to ``target.path``, replacing only the
    checkpoint the kernel saw there (``target.replaces``) and nothing else."""
    if target.private:
        _make_private(target.partial)
    meta.write_marker(target.partial, private=target.private)
    path = target.path
    if target.replaces is not None and os.path.lexists(path):
        if fingerprint(path) != target.replaces:
            raise _occupied(target)
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        _move_in(target, old)  # a crash before this completes: Checkpoint.read finds one beside
        if os.path.islink(old):
            os.unlink(old)  # the path was a link to the old checkpoint: keep what it named
        else:
            shutil.rmtree(old, ignore_errors=True)  # the new one is in place already
    else:
        _move_in(target)


def _move_in(target: SaveTarget, old: str | None = None) -> None:
    """Rename the complete partial directory to ``target.path`` if nothing is there."""
    try:
        os.mkdir(target.path, 0o700)  # the claim: fails if anyone created anything there
    except FileExistsError:
        raise _occupied(target, old) from None
    try:
        os.rename(target.partial, target.path)  # replaces only the empty directory just made
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise _occupied(target, old) from None  # someone wrote into the claim: theirs now
    _fsync_dir(os.path.dirname(target.path))


def _occupied(target: SaveTarget, old: str | None = None) -> FileExistsError:
    was = "another checkpoint" if target.replaces is not None else "nothing"
    aside = f" (the checkpoint it was to replace is in {old})" if old else ""
    return FileExistsError(
        f"something else appeared at {target.path} while the checkpoint was being written "
        f"(there was {was} when the save began); it was left untouched. The new checkpoint "
        f"is complete in {target.partial}{aside}: load it from there, or move it where you "
        "want it"
    )


def _make_private(directory: str) -> None:
    """Owner-only modes: directories 0o700, files 0o600."""
    os.chmod(directory, PRIVATE_DIR_MODE)
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            os.chmod(os.path.join(root, d), PRIVATE_DIR_MODE)
        for f in files:
            os.chmod(os.path.join(root, f), PRIVATE_FILE_MODE)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        optimizer=optimizer_class(state.optimizer),
        model=model_shapes(state.module),
        trainer=trainer_state(state, bool(tensors["optimizer"].get("state"))),
    )


def complete(meta: Checkpoint, partial: str, path: str, *, private: bool = True) -> None:
    """(One rank, once every part is on disk) mark ``partial`` complete and move it to a new
    ``path`` (owner-only if ``private``), as :func:`save` does."""
    target = SaveTarget(path=path, partial=partial, kind=meta.kind, replaces=None, private=private)
    _complete(meta, target)
