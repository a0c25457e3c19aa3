"""``cluster.resize(n)`` (``%axon_cluster --resize N``) adds or removes ranks of a live
cluster: new engines start in a second launch and the world re-forms at the new size. A run
in progress (``block=False``) stops at a step boundary, moves to the new world in memory and
goes on with its global batch, so the whole run equals ``train_local`` at 1e-5 under DDP,
FSDP and ZeRO-1/2/3, growing and shrinking; between calls ``train(resume=True)`` goes on at
the new size. What cannot be kept is refused before anything changes, or dropped by name.
(Across hosts: ``tests/test_hosts.py``.)"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from resize_runs import (
    RUN,
    STEPS,
    equal_to_reference,
    held_while,
    reference,
    resize_during_run,
    slow_loss,
    world_sizes,
)  # fmt: skip

import axon_nb
from axon_nb import DDP, FSDP, DiLoCo, Hybrid, ZeRO
from axon_nb.cluster.host_fit import usable_cores
from axon_nb.models import token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def resizable(shell: Any) -> Any:
    """A cluster of this module's own (it changes size), started by the magic."""
    shell.run_line_magic("axon_cluster", "2 --timeout 60")
    started = shell.magics_manager.registry["AxonMagics"].cluster
    yield started
    shell.run_line_magic("axon_cluster", "--stop")


def _resized_to(cluster: axon_nb.Cluster, n: int) -> None:
    if len(cluster.ranks) != n:
        cluster.resize(n)


STRATEGIES = [DDP(), FSDP(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_a_run_goes_on_through_a_resize_as_train_local(
    resizable: Any, strategy: Any, tmp_path: Path
) -> None:
    cluster = resizable
    old = len(cluster.ranks)
    new = 4 if old == 2 else 2  # grows, then shrinks, then grows ...
    tracked = isinstance(strategy, DDP)  # (and TensorBoard follows it through, once)
    train = {"log_to": "tensorboard", "log_dir": str(tmp_path)} if tracked else {}
    result, changed = resize_during_run(cluster, strategy, new, train)
    assert cluster.options.n == new
    if tracked:
        _check_events(tmp_path, result, changed["step"], new)
    # The dashboard: the ranks that joined or left, and the run on through them.
    state = result.dashboard.state
    moved = f"{old} -> {new} ranks"
    assert any(moved in note for note in state.notes), state.notes
    statuses = [row["status"] for row in state.snapshot()["ranks"]]
    if new < old:
        assert statuses == ["finished"] * new + ["left"] * (old - new)
    else:
        assert statuses == ["finished"] * new
    assert state.steps[-1] == STEPS


def test_between_calls_train_resume_goes_on_at_the_new_size(resizable: Any, capsys: Any) -> None:
    cluster = resizable
    _resized_to(cluster, 2)
    cluster.train(**RUN, steps=1, name="other")
    first = cluster.train(**RUN, steps=5)  # the latest run: it moves
    cluster.execute(
        "import torch\nimport torch.distributed as dist\n"
        "group = dist.new_group(list(range(world_size)))\n"
        "wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "plain = torch.nn.Linear(2, 2)\n",
        stream=False,
    )
    capsys.readouterr()
    changed = cluster.resize(4)
    said = capsys.readouterr().err
    assert changed["moved"] == "model" and changed["runs"] == ["other"]
    assert changed["objects"] == ["group", "wrapped"]
    assert "Dropped the runs kept on the old world: other" in said, said
    assert "group, wrapped" in said and "ranks 2-3 joined" in said, said
    held = cluster.run(_names, ("group", "wrapped", "plain"), stream=False)
    assert held == [["plain"], ["plain"], [], []]  # (ranks 2 and 3 never had one)
    then = cluster.train(**RUN, steps=7, resume=True)
    assert then.layout_change is not None and then.layout_change["to"] == "DDP() · 4 ranks"
    want = reference(12).losses
    for got, ref in zip(first.losses + then.losses, want, strict=True):
        assert got == pytest.approx(ref, rel=1e-5)
    with pytest.raises(axon_nb.RankError, match="no training run named 'other'"):
        cluster.train(**RUN, steps=1, resume=True, name="other")


def test_bad_resizes_are_refused_before_anything_changes(resizable: Any, tmp_path: Path) -> None:
    cluster = resizable
    _resized_to(cluster, 2)
    cluster.train(**RUN, steps=2)
    before = [dict(r) for r in cluster.ranks]
    for bad in (0, -1, 2.5, True, "four"):
        with pytest.raises(ValueError, match="positive integer"):
            cluster.resize(bad)
    with pytest.raises(ValueError, match="batch_size=16"):
        cluster.resize(3)  # 16 samples do not split over 3 ranks
    with pytest.raises(ValueError, match="across hosts"):
        cluster.resize(add_hosts="elsewhere:2")
    strict = dataclasses.replace(cluster.options, oversubscribe=False)
    cluster.options, kept = strict, cluster.options
    try:
        with pytest.raises(ValueError, match="cores"):
            cluster.resize(usable_cores() + 1)
    finally:
        cluster.options = kept
    cluster.train(**{**RUN, "batch_size": 4}, strategy=Hybrid(tp=2), steps=1, name="tp")
    with pytest.raises(ValueError, match="'tp'"):
        cluster.resize(3)  # tensor parallel over 2 does not divide 3 ranks
    cluster.train(**RUN, strategy=DiLoCo(inner_steps=2), steps=2, name="outer")
    with pytest.raises(ValueError, match="outer loop"):
        cluster.resize(4)
    # A run in progress on a stream goes on, untouched (held in its first step meanwhile).
    hold = tmp_path / "hold"
    hold.touch()
    handle = cluster.train(**{**RUN, "loss": held_while(str(hold)), "data": _stream()},
                           steps=6, block=False, name="stream")  # fmt: skip
    try:
        with pytest.raises(ValueError, match="stream"):
            cluster.resize(4)
        with pytest.raises(ValueError, match="keep=False would drop it mid-run"):
            cluster.resize(4, keep=False)
        assert not handle.done
    finally:
        hold.unlink()
    assert handle.wait().step == 6 and not handle.wait().resizes
    assert cluster.ranks == before and world_sizes(cluster) == [2, 2]
    # keep=False carries no run over: a size the latest run does not fit is then allowed
    changed = cluster.resize(3, keep=False)
    assert changed["moved"] is None and "stream" in changed["runs"] and "tp" in changed["runs"]
    assert world_sizes(cluster) == [3, 3, 3]


def _check_events(log_dir: Path, result: Any, resized_at: int, new: int) -> None:
    """Every step once in TensorBoard, its loss the result's; the new ranks' own figures
    from the step after the resize on (written as each step's ranks are all in)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    deadline = time.monotonic() + 30  # (the tracking thread writes after the run's end)
    while True:
        events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        events.Reload()
        tags = events.Tags()["scalars"]
        if "train/loss" in tags and len(events.Scalars("train/loss")) == STEPS:
            break
        assert time.monotonic() < deadline, tags
        time.sleep(0.2)
    written = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert written == [(h["step"], pytest.approx(h["loss"], rel=1e-6)) for h in result.history]
    last = f"rank{new - 1}/step_time_s"
    assert [e.step for e in events.Scalars(last)] == list(range(resized_at + 1, STEPS + 1))
    assert [e.step for e in events.Scalars("rank0/step_time_s")] == list(range(1, STEPS + 1))


def _names(names: tuple[str, ...]) -> list[str]:
    """(On a rank) which of ``names`` its namespace holds."""
    from IPython import get_ipython

    return [name for name in names if name in get_ipython().user_ns]


class _Tokens(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        yield from token_dataset(512, block_size=16, vocab_size=64)


def _stream() -> _Tokens:
    return _Tokens()


def test_the_magic_resizes_and_says_what_changed(resizable: Any, shell: Any, capsys: Any) -> None:
    cluster = resizable
    _resized_to(cluster, 2)
    shell.run_line_magic("axon_cluster", "--resize 4")
    out = capsys.readouterr()
    assert "from 2 to 4 ranks" in out.err and "ranks 2-3 joined" in out.err
    assert len(out.out.strip().splitlines()) == 5  # the table: a header and 4 ranks
    with pytest.raises(UsageError, match="batch_size=16"):  # (the latest run's batch)
        shell.run_line_magic("axon_cluster", "--resize 3")
    shell.run_line_magic("axon_cluster", "--resize 2")
    assert "ranks 2-3 left" in capsys.readouterr().err
    with pytest.raises(UsageError, match="number of ranks"):
        shell.run_line_magic("axon_cluster", "--resize many")
    assert world_sizes(cluster) == [2, 2]


def test_a_resize_whose_new_ranks_cannot_start_loses_nothing(resizable: Any) -> None:
    """The new engines' launch fails: they are ended, the world stays as it was and the run
    in progress goes on there, equal to ``train_local``."""
    cluster = resizable
    _resized_to(cluster, 2)
    launcher = cluster._ipp.config.MPIEngineSetLauncher
    works, launcher.engine_cmd = launcher.engine_cmd, [sys.executable, "-c", "exit(3)"]
    try:
        handle = cluster.train(**{**RUN, "loss": slow_loss}, steps=STEPS, metrics_interval_s=0.1,
                               block=False)  # fmt: skip
        while len(handle.history) < 3:
            time.sleep(0.02)
        with pytest.raises(axon_nb.ClusterStartError, match="launch ended"):
            cluster.resize(4)
    finally:
        launcher.engine_cmd = works
    result = handle.wait()
    assert not result.resizes and len(result.ranks) == 2
    equal_to_reference(cluster, result)
    assert world_sizes(cluster) == [2, 2] and cluster.options.n == 2
    assert sorted(cluster.client.ids) == [0, 1]
    cluster.resize(4)  # and the next one works
    assert world_sizes(cluster) == [4] * 4
