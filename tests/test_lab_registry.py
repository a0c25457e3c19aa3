"""The kernel side of JupyterLab's Axon sidebar: a real 2-rank cluster publishes its state
into an owner-only runtime directory, and carries out the controls written there (stop the
run at a step boundary, restart, stop the cluster)."""

from __future__ import annotations

import json
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from models import make_data, make_mlp, mse

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ARGS: dict[str, Any] = dict(model=make_mlp, data=make_data, loss=mse, batch_size=32)


@pytest.fixture()
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("AXON_NB_KERNEL_ID", "k1")  # as if started in kernel k1
    return tmp_path / "runtime" / "axon_nb"


def _until(check: Callable[[], Any], what: str, seconds: float = 60) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _state(directory: Path) -> dict[str, Any] | None:
    files = list(directory.glob("cluster-k1-*.json"))
    return json.loads(files[0].read_text()) if files else None


def _send(directory: Path, key: str, action: str) -> None:
    partial = directory / f"control-{key}-{uuid.uuid4().hex}.partial"
    partial.write_text(json.dumps({"action": action, "requested": time.time()}))
    partial.rename(partial.with_suffix(".json"))


@pytest.fixture()
def registered_cluster(runtime: Path) -> Iterator[axon_nb.Cluster]:
    """Two ranks started for the test in kernel k1, publishing into ``runtime``."""
    with axon_nb.Cluster(n=2, timeout=120) as c:
        yield c


def test_state_is_published_owner_only_and_controls_are_carried_out(
    runtime: Path, registered_cluster: axon_nb.Cluster
) -> None:
    state = _until(lambda: _state(runtime), "the state file")
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    path = next(runtime.glob("cluster-k1-*.json"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert state["kernel_id"] == "k1" and state["ranks"] == 2 and state["status"] == "running"
    assert state["devices"] == ["cpu", "cpu"] and state["backend"] == "gloo"
    assert state["run"] is None

    handle = registered_cluster.train(**ARGS, steps=1_000_000, block=False)
    running = _until(
        lambda: (s := _state(runtime)) and s["run"] and s["run"]["step"] >= 3 and s, "progress"
    )
    run = running["run"]
    assert run["state"] == "running" and run["strategy"] == "DDP()" and run["steps"] == 1_000_000
    assert len(run["losses"]) >= 2 and run["samples_per_s"] > 0 and run["eta_s"] > 0
    assert len(running["memory"]) == 2 and running["memory"][0]["used"] > 0
    dashboard = run["dashboard"]
    assert {"title", "progress", "ranks", "memory", "communication", "loss"} <= set(dashboard)

    _send(runtime, state["key"], "stop_run")
    result = handle.wait(timeout=60)
    assert result.stopped  # every rank at the same step boundary
    steps = registered_cluster.run(_model_step, stream=False)
    assert steps[0] == steps[1] == result.step
    _until(lambda: _state(runtime)["run"]["state"] == "stopped", "the stopped run")
    assert not list(runtime.glob("control-*"))  # read and removed

    pids = [r["pid"] for r in registered_cluster.ranks]
    _send(runtime, state["key"], "restart")
    _until(lambda: registered_cluster.running and registered_cluster.ranks and
           [r["pid"] for r in registered_cluster.ranks] != pids, "new ranks")  # fmt: skip
    _until(lambda: _state(runtime) and _state(runtime)["key"] != state["key"], "a new entry")
    new = _state(runtime)
    assert new["status"] == "running" and new["run"] is not None  # the last run is kept
    assert registered_cluster.run(lambda: 1, stream=False) == [1, 1]

    _send(runtime, new["key"], "stop_cluster")
    _until(lambda: not registered_cluster.running, "the cluster to stop")
    _until(lambda: _state(runtime) is None, "the entry to go")


def test_no_entry_outside_a_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from axon_nb.cluster.lab_registry import LabRegistry

    monkeypatch.delenv("AXON_NB_KERNEL_ID", raising=False)
    assert LabRegistry.for_kernel(axon_nb.Cluster(n=2)) is None  # pytest is not a kernel
    with pytest.raises(ValueError, match="a registry key has only letters"):
        LabRegistry(axon_nb.Cluster(n=2), "../escape", directory=tmp_path)


def test_entries_of_dead_kernels_are_pruned(tmp_path: Path) -> None:
    import subprocess
    import sys

    from axon_nb.cluster.lab_registry import prune

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    (tmp_path / "cluster-dead-1.json").write_text(json.dumps({"pid": int(gone)}))
    (tmp_path / "control-dead-1-x.json").write_text("{}")
    (tmp_path / "cluster-live-1.json").write_text(json.dumps({"pid": __import__("os").getpid()}))
    prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster-live-1.json"]


def _model_step() -> int:
    from axon_nb.rank.training import trainstate

    return trainstate.get("model").step


def test_the_sidebar_gets_a_runs_layout_change(tmp_path: Path) -> None:
    """A ``resume=True`` call that moved the run to another strategy: its entry names the
    change (the sidebar's text and sparkline mark) and the dashboard tab's state carries it."""
    from types import SimpleNamespace

    from recorded_stream import MOVE, STREAM, with_layout_change

    from axon_nb.cluster.lab_registry import LOSS_POINTS, LabRegistry
    from axon_nb.strategies import FSDP
    from axon_nb.widgets.dashboard import Dashboard

    cluster = axon_nb.Cluster(n=2)  # not started: the registry reads what it holds
    board = Dashboard(2, title="model · FSDP · 2 ranks")
    for rank, message in with_layout_change(STREAM["finished"])["messages"]:
        board.message(rank, message)
    board.done({})
    spec = SimpleNamespace(strategy=FSDP())
    cluster.last_run = SimpleNamespace(name="model", done=True, dashboard=board, _spec=spec)
    registry = LabRegistry(cluster, "k1-abcd1234", directory=tmp_path)
    registry.write()
    run = json.loads(registry.path.read_text())["run"]
    assert run["strategy"] == "FSDP()" and run["state"] == "finished"
    assert run["layout_changes"] == [MOVE] == run["dashboard"]["layout_changes"]
    # the sparkline: the call's whole curve, from right after the change to its newest step
    assert run["losses"][0][0] == MOVE["step"] + 1 and run["losses"][-1][0] == 120
    assert len(run["losses"]) <= LOSS_POINTS + 1
