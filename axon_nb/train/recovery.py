"""Automatic recovery: when a rank dies during ``train(max_restarts=n)``, restart the ranks,
rebuild the run, load the newest complete periodic checkpoint and train on to the step count
asked for, without the user doing anything.

The resumed run continues the checkpoint's step count, optimizer, schedule, random state and
data order, so for a deterministic model it ends exactly where an uninterrupted run ends.
Steps after the checkpoint are computed again; ``result.history`` is one continuous history
(the recomputed steps replace the lost ones) and ``result.restarts`` says what happened.

With ``min_ranks``, a rank that cannot come back (the ranks do not all start again, or the
same rank dies in the restarted run too) is left out: the run goes on with the largest
number of ranks, at least ``min_ranks``, that its layout and global batch fit, loading the
checkpoint resharded. The result then differs from an uninterrupted run by the floating-point
order of the smaller world's reductions.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from axon_nb.checkpoint.on_cluster import load
from axon_nb.errors import AxonError, ClusterBrokenError, ClusterStartError, RankDiedError
from axon_nb.spec.checkpoint_series import latest, remove_partial
from axon_nb.spec.train_spec import TrainSpec
from axon_nb.spec.validation import check_world
from axon_nb.train.handle import TrainHandle
from axon_nb.train.result import TrainResult

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

Start = Callable[[TrainSpec, list[str]], TrainHandle]
"""Starts a run of a spec on the cluster (with notes for its dashboard); returns its handle."""


def train_with_restarts(cluster: ClusterLike, spec: TrainSpec, start: Start) -> TrainResult:
    """Run ``spec`` to its end, recovering from dead ranks up to ``spec.max_restarts`` times."""
    assert spec.checkpoint_dir is not None
    handle = start(spec, [])
    history: dict[int, dict[str, Any]] = {}
    restarts: list[dict[str, Any]] = []
    first_step: int | None = None
    target: int | None = None
    while True:
        handle.restart_on_death = len(restarts) < spec.max_restarts  # (else the user may rescue)
        try:
            result = handle.wait()
            break
        except (RankDiedError, ClusterBrokenError) as error:
            failed_at = _keep_history(handle, history)
            if first_step is None:
                bounds = _bounds(handle, spec)
                if bounds is None:
                    print(
                        "Not restarting: the resumed run failed before any rank reported the "
                        "step it resumed from",
                        file=sys.stderr,
                    )
                    raise
                first_step, target = bounds
            if len(restarts) >= spec.max_restarts:
                raise
            began = time.monotonic()
            ckpt = latest(spec.checkpoint_dir)
            resumed_from = ckpt.step if ckpt is not None else first_step
            note = (
                f"restart {len(restarts) + 1}/{spec.max_restarts}: {error.__class__.__name__} at "
                f"step {failed_at}; resuming from "
                + (f"checkpoint step {resumed_from}" if ckpt else "the start (no checkpoint yet)")
            )
            world = _world_after(cluster, spec, error, restarts)
            if world < len(cluster.ranks) and isinstance(error, RankDiedError):
                note += f"; rank {error.rank} died again, so going on with {world} ranks"
            print(note, file=sys.stderr)
            world = _restart(cluster, spec, world)
            remove_partial(spec.checkpoint_dir)
            assert target is not None
            if ckpt is None:
                continued = dataclasses.replace(spec, steps=target - first_step)
            else:
                _rebuild(cluster, spec)
                load(cluster, ckpt.path, name=spec.name)
                continued = dataclasses.replace(spec, steps=target - ckpt.step, resume=True)
            restarts.append(
                {
                    "error": str(error),
                    "rank": getattr(error, "rank", None),
                    "world_size": world,
                    "failed_at_step": failed_at,
                    "resumed_from": resumed_from,
                    "seconds": time.monotonic() - began,
                }
            )
            handle = start(continued, [note])
    for entry in result.history:
        history[entry["step"]] = entry
    return dataclasses.replace(
        result,
        history=[history[s] for s in sorted(history)],
        start_step=first_step if first_step is not None else result.start_step,
        restarts=restarts,
    )


def _world_after(
    cluster: ClusterLike, spec: TrainSpec, error: Exception, restarts: list[dict[str, Any]]
) -> int:
    """How many ranks to restart: as many as before, unless ``min_ranks`` allows fewer and
    the rank that died had died in the run before too (it cannot come back)."""
    world = len(cluster.ranks)
    rank = getattr(error, "rank", None)  # (a ClusterBrokenError names none)
    again = rank is not None and bool(restarts) and restarts[-1]["rank"] == rank
    if spec.min_ranks is None or not again:
        return world
    return _smaller_world(cluster, spec, world, error)


def _restart(cluster: ClusterLike, spec: TrainSpec, world: int) -> int:
    """Restart with ``world`` ranks, or (with ``min_ranks``) fewer while starting fails; the
    number started."""
    while True:
        try:
            cluster.restart(n=world)
            return world
        except ClusterStartError as error:
            if spec.min_ranks is None:
                raise
            world = _smaller_world(cluster, spec, world, error)
            print(f"the ranks did not all start ({error}); trying {world}", file=sys.stderr)


def _smaller_world(cluster: ClusterLike, spec: TrainSpec, world: int, error: Exception) -> int:
    """The largest number of ranks below ``world`` and at least ``min_ranks`` that the run's
    layout and batch fit; raises (from ``error``) when there is none."""
    assert spec.min_ranks is not None
    one_host = cluster.options.n == cluster.ranks_per_host or not cluster.ranks
    refused = []
    for n in range(world - 1, spec.min_ranks - 1, -1):
        try:
            check_world(spec, n, n if one_host else cluster.ranks_per_host)
            return n
        except ValueError as why:
            refused.append(f"{n}: {why}")
    raise AxonError(
        f"the run cannot go on: a rank cannot come back, and no world of {spec.min_ranks} to "
        f"{world - 1} ranks fits it ("
        + ("; ".join(refused) or f"min_ranks={spec.min_ranks} is not below {world}")
        + "). Its newest checkpoint is in "
        f"{spec.checkpoint_dir}"
    ) from error


def _keep_history(handle: TrainHandle, history: dict[int, dict[str, Any]]) -> int:
    """Keep what a failed call streamed; the last step it reached."""
    streamed = handle.history
    for entry in streamed:
        history[entry["step"]] = entry
    return streamed[-1]["step"] if streamed else 0


def _bounds(handle: TrainHandle, spec: TrainSpec) -> tuple[int, int] | None:
    """The step the first call started at, and the step the run must reach; None when that
    is unknown (a resumed run that failed before any rank reported)."""
    latest_messages = handle.latest
    if latest_messages:
        start = next(iter(latest_messages.values()))["start_step"]
    elif not spec.resume:
        start = 0  # it failed before any rank reported: a fresh run starts at 0
    else:
        return None
    return start, start + spec.steps


def _rebuild(cluster: ClusterLike, spec: TrainSpec) -> None:
    """Build the run (model, optimizer, schedule) on fresh ranks, training nothing."""
    build = dataclasses.replace(
        spec,
        steps=0,
        resume=False,
        checkpoint_dir=None,
        checkpoint_every=None,
        checkpoint_every_s=None,
        keep=None,
        max_restarts=0,
        metrics_interval_s=0,
    )
    from axon_nb.train.start import start_run

    start_run(cluster, build, show=False).wait()
