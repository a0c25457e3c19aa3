"""Automatic recovery: when a rank dies during ``train(max_restarts=n)``, restart the ranks,
rebuild the run, load the newest complete periodic checkpoint and train on to the step count
asked for, without the user doing anything.

The resumed run continues the checkpoint's step count, optimizer, schedule, random state and
data order, so for a deterministic model it ends exactly where an uninterrupted run ends.
Steps after the checkpoint are computed again; ``result.history`` is one continuous history
(the recomputed steps replace the lost ones) and ``result.restarts`` says what happened.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from axon_nb.checkpoint.on_cluster import load
from axon_nb.checkpoint.series import latest, remove_partial
from axon_nb.errors import ClusterBrokenError, RankDiedError
from axon_nb.train.handle import TrainHandle
from axon_nb.train.result import TrainResult
from axon_nb.train.spec import TrainSpec

if TYPE_CHECKING:
    from axon_nb.cluster import Cluster

Start = Callable[[TrainSpec, list[str]], TrainHandle]
"""Starts a run of a spec on the cluster (with notes for its dashboard); returns its handle."""


def train_with_restarts(cluster: Cluster, spec: TrainSpec, start: Start) -> TrainResult:
    """Run ``spec`` to its end, recovering from dead ranks up to ``spec.max_restarts`` times."""
    assert spec.checkpoint_dir is not None
    handle = start(spec, [])
    history: dict[int, dict[str, Any]] = {}
    restarts: list[dict[str, Any]] = []
    first_step: int | None = None
    target: int | None = None
    while True:
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
            print(note, file=sys.stderr)
            cluster.restart()
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


def _rebuild(cluster: Cluster, spec: TrainSpec) -> None:
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
    from axon_nb.train.on_cluster import start_run

    start_run(cluster, build, show=False).wait()
