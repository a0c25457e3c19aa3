"""Checkpoints taken by the training loop every n steps or seconds, written in the background.

A save is started at a step boundary with ``torch.distributed.checkpoint.async_save``: the
state is staged (copied) at once and written by a background thread, over a gloo process group
of its own, so the steps go on while the disk works. It is complete when every rank's write
has finished; the ranks agree on that in the loop's per-step all-reduce (no extra collective),
and then rank 0 writes the marker and moves the directory into place, as ``cluster.save``
does. Only the newest ``keep`` complete checkpoints stay.

Checkpoints are named ``<checkpoint_dir>/step-00000050`` (``axon_nb.spec.checkpoint_series``, where
the kernel finds the newest complete one to resume from after a failure).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from axon_nb.rank import runtime
from axon_nb.rank.checkpoint import checkpoint_io
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.checkpoint_format import Checkpoint
from axon_nb.spec.checkpoint_series import checkpoints, path_for


@dataclass
class _Pending:
    future: Future[Any]
    meta: Checkpoint
    partial: str


class PeriodicCheckpoints:
    """The loop's checkpoint schedule for one ``train`` call.

    Example (what the loop does each step)::

        every = PeriodicCheckpoints("ckpt/run1", steps=50, seconds=None, keep=3, ctx=ctx,
                                    run_id=run_id)
        done_here = every.written()              # into the step's all-reduce
        every.after_agreement(all_done, time_due, state)
    """

    def __init__(
        self,
        directory: str,
        *,
        steps: int | None,
        seconds: float | None,
        keep: int | None,
        ctx: runtime.RankContext,
        run_id: str,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.steps = steps
        self.seconds = seconds
        self.keep = keep
        self.ctx = ctx
        self.run_id = run_id
        """The same on every rank: names the directories being written."""
        self.last: dict[str, Any] | None = None
        """The newest complete checkpoint of this call: ``{"step", "path"}``."""
        self._pending: _Pending | None = None
        self._since = time.monotonic()
        # async_save runs its planning collectives in a background thread: on a group of its
        # own, so they never interleave with the training's collectives.
        self._group = _save_group() if ctx.world_size > 1 else None
        # The same layout every time: the planner caches its plans and skips re-planning.
        # (DCP is imported here, by the runs that checkpoint: 1 s of CPU.)
        from torch.distributed.checkpoint import DefaultSavePlanner

        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        if ctx.rank == 0:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def written(self) -> bool:
        """True when this rank has a save in flight whose write has finished."""
        return self._pending is not None and self._pending.future.done()

    def time_due(self) -> bool:
        """This rank's clock says a time-based checkpoint is due (agreed in the all-reduce)."""
        return self.seconds is not None and time.monotonic() - self._since >= self.seconds

    def after_agreement(
        self, all_written: bool, time_due: bool, state: TrainState, *, last: bool
    ) -> None:
        """At a step boundary, with what every rank agreed: complete the save in flight when
        every rank's write is done, and start a new one when it is due."""
        if self._pending is not None and all_written:
            self._finish_pending()
        due = (self.steps is not None and state.step % self.steps == 0) or time_due
        if not due or last:
            return
        if self._pending is not None:  # the disk is slower than the interval: wait for it
            self._pending.future.result()
            self._barrier()
            self._finish_pending()
        self._start(state)

    def close(self) -> None:
        """End of the call: wait for the save in flight and complete it (every rank)."""
        if self._pending is None:
            return
        self._pending.future.result()
        self._barrier()
        self._finish_pending()

    def _start(self, state: TrainState) -> None:
        path = path_for(self.directory, state.step)
        partial = f"{path}.partial-{self.run_id}"
        tensors = state.parallel.get_state(state.optimizer, full=False)
        kept = checkpoint_io.strategy_tensors(state)
        if kept is not None:  # (copied before the save returns: async_save stages first)
            tensors["strategy"] = kept
        # Each rank writes its own random state: the same layout as a gathered one, without
        # a collective at the step boundary.
        tensors["rng"] = {str(self.ctx.rank): torch.get_rng_state()}
        meta = checkpoint_io.describe(state, self.ctx, path, "sharded", tensors)
        os.makedirs(partial, mode=0o700, exist_ok=True)  # owner-only while written, too
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save(
            tensors, checkpoint_id=partial, process_group=self._group, planner=self._planner
        )
        assert isinstance(future, Future)  # (an AsyncSaveResponse comes with async staging only)
        self._pending = _Pending(future=future, meta=meta, partial=partial)
        self._since = time.monotonic()

    def _finish_pending(self) -> None:
        assert self._pending is not None
        pending, self._pending = self._pending, None
        pending.future.result()  # raise this rank's write error, if any
        if self.ctx.rank == 0:
            checkpoint_io.complete(pending.meta, pending.partial, pending.meta.path)
            self._prune()
        self.last = {"step": pending.meta.step, "path": pending.meta.path}

    def _prune(self) -> None:
        if self.keep is None:
            return
        complete = checkpoints(self.directory)
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            dist.barrier()


_SAVE_GROUP: tuple[Any, Any] | None = None


def _save_group() -> Any:
    """The gloo group background saves plan on, made once per world (one call saves at a
    time; a group per call would keep its threads and sockets for the world's life)."""
    global _SAVE_GROUP
    world = dist.group.WORLD
    if _SAVE_GROUP is None or _SAVE_GROUP[0] is not world:
        _SAVE_GROUP = (world, dist.new_group(backend="gloo"))
    return _SAVE_GROUP[1]


def forget_save_group() -> None:
    """Drop the kept save group (its world is being destroyed)."""
    global _SAVE_GROUP
    _SAVE_GROUP = None
