"""Save, load and continue a run on the ranks, beside the same run continued in memory: what
the tests of strategies with state of their own in checkpoints share (DiLoCo, AsyncSGD)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import axon_nb


def continued_both_ways(
    cluster: axon_nb.Cluster,
    args: dict[str, Any],
    path: Path,
    kind: str,
    *,
    target: axon_nb.Cluster | None = None,
) -> tuple[axon_nb.TrainResult, axon_nb.TrainResult]:
    """Train 6 steps as run "a", save it (``kind``), train 6 more; build run "b" (on
    ``target``, by default the same cluster), load the checkpoint and train the same 6: both
    continuations' results."""
    args = {k: v for k, v in args.items() if k != "steps"}
    cluster.train(**args, steps=6, name="a")
    assert cluster.save(path, kind, name="a").step == 6
    uninterrupted = cluster.train(**args, steps=6, name="a", resume=True)
    target = target or cluster
    target.train(**args, steps=0, name="b")
    assert target.load(path, name="b").step == 6
    return uninterrupted, target.train(**args, steps=6, name="b", resume=True)
