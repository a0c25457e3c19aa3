"""Every stop path ends every rank process within 10 s, whatever the ranks are doing.

Asserted by pid: the processes under the kernel (controller, MPI launcher, each rank's parent,
engine and nanny) are collected before the stop and must all be gone after it.
"""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
from busy import MODES, train_forever
from helpers import cluster_pids, wait_gone
from IPython.core.error import UsageError

import axon_nb
from axon_nb.cluster import warm_engines
from axon_nb.spec.stop_waits import ASK_S, KILL_AFTER_S

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(120),
]

STOP_S = 10.0
"""What the README promises for every stop path."""


def make_busy(cluster: axon_nb.Cluster, mode: str) -> None:
    if mode == "train":
        train_forever(cluster)
    else:
        cluster.send(MODES[mode])
    time.sleep(1.5)  # well inside the call


def test_the_waits_fit_the_promise() -> None:
    assert ASK_S + KILL_AFTER_S + 2.0 < STOP_S


@pytest.mark.parametrize("mode", ["train", "sleep", "collective", "native"])
def test_stop_ends_busy_ranks(mode: str) -> None:
    threads = set(threading.enumerate())
    cluster = axon_nb.Cluster(n=2, timeout=60).start()
    pids = cluster_pids()
    assert len(pids) >= 8  # controller, mpiexec, reaper, and 3 per rank
    make_busy(cluster, mode)
    monitors = [t for t in set(threading.enumerate()) - threads if t.name == "axon-train-monitor"]
    assert monitors or mode != "train"
    started = time.monotonic()
    cluster.stop()
    assert wait_gone(pids, seconds=0.5) == []
    assert time.monotonic() - started < STOP_S
    # nor does anything of it go on in the kernel: a run's monitor thread ends with its ranks
    # (it polled ten times a second for the rest of the kernel's life)
    for thread in monitors:
        thread.join(timeout=10.0)
    assert not any(t.is_alive() for t in monitors)


@pytest.mark.parametrize(("engines", "n"), [("local", 2), ("mpi", 4)])
def test_stop_ends_ranks_stuck_in_a_collective(engines: str, n: int) -> None:
    cluster = axon_nb.Cluster(n=n, engines=engines, timeout=60, oversubscribe=True).start()
    pids = cluster_pids()
    make_busy(cluster, "collective")
    started = time.monotonic()
    cluster.stop()
    assert wait_gone(pids, seconds=0.5) == []
    assert time.monotonic() - started < STOP_S


class _GoneAt(threading.Thread):
    """Watches ``pids`` from now on: ``at`` is when the last of them was gone."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.at = pids, None
        self.start()

    def run(self) -> None:
        while any(psutil.pid_exists(p) and _living(p) for p in self.pids):
            time.sleep(0.05)
        self.at = time.monotonic()


def _living(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_magic_stop_and_restart_end_busy_ranks(shell, capsys) -> None:
    shell.run_line_magic("axon_cluster", "2 --timeout 60")
    try:
        cluster = axon_nb.current_cluster()
        # (the warm process that forks engines stays for the restart's new ones)
        first = [pid for pid in cluster_pids() if pid != warm_engines.server_pid()]
        make_busy(cluster, "sleep")
        started = time.monotonic()
        gone = _GoneAt(first)
        shell.run_line_magic("axon_cluster", "--restart")
        gone.join(timeout=0.5)
        # the old ranks went within the stop's promise (the restart then starts new ones)
        assert gone.at is not None and gone.at - started < STOP_S
        second = axon_nb.current_cluster()
        assert second.run(lambda: 1) == [1, 1]
        pids = cluster_pids()
        make_busy(second, "native")
        capsys.readouterr()
        started = time.monotonic()
        shell.run_line_magic("axon_cluster", "--stop")
        assert wait_gone(pids, seconds=0.5) == []
        assert time.monotonic() - started < STOP_S
        assert capsys.readouterr().out == "Stopped the cluster (2 ranks).\n"
    finally:  # a failure leaves no busy ranks to the tests after it
        shell.run_line_magic("axon_cluster", "--stop")


def test_a_clean_stop_is_one_line_and_every_engine_exits_0(shell, capsys) -> None:
    shell.run_line_magic("axon_cluster", "2 --timeout 60")
    cluster = axon_nb.current_cluster()
    log = cluster.log
    assert log is not None and log.path.stat().st_mode & 0o077 == 0  # owner-only
    ipc = cluster._ipp
    assert ipc is not None and ipc.controller is not None
    files = [ipc.cluster_file, ipc.controller.output_file,
             *(engines.output_file for engines in ipc.engines.values())]  # fmt: skip
    assert len(files) == 3 and all(map(os.path.exists, files))
    capsys.readouterr()
    shell.run_line_magic("axon_cluster", "--stop")
    # ipyparallel's files go, and its exit handler has nothing left to stop
    assert [f for f in files if os.path.exists(f)] == []
    assert not ipc.engines and ipc.controller is None
    captured = capsys.readouterr()
    assert captured.out == "Stopped the cluster (2 ranks).\n"
    assert captured.err == ""
    text = log.path.read_text()
    assert "Registering with controller" in text  # the engines' log went to the file
    assert "exit_code" not in text or "'exit_code': 0" in text
    assert "Traceback" not in text  # (an engine that ended on the request exits 0)


def test_engines_on_their_own_launchers_exit_0_on_a_clean_stop() -> None:
    """Local engines: each rank's parent is the launcher's process, so its exit code (the
    engine's) is seen directly. ipyparallel's engine raised "Event loop stopped before
    Future completed" on the shutdown request and exited 1."""
    cluster = axon_nb.Cluster(n=2, engines="local", timeout=60).start()
    launchers = [
        launcher
        for engine_set in cluster._ipp.engines.values()  # type: ignore[union-attr]
        for launcher in engine_set.launchers.values()
    ]
    assert len(launchers) == 2
    cluster.stop()
    codes = [launcher.process.wait(timeout=5) for launcher in launchers]
    log = cluster.log.path.read_text()  # type: ignore[union-attr]
    assert codes == [0, 0], log[-4000:]  # (what an engine printed as it ended)
    assert "Traceback" not in log


# -- refused before anything is launched -------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
@pytest.mark.parametrize("flag", ["--timeout", "--hang-timeout"])
def test_bad_timeouts_are_refused_before_launching(shell, flag: str, value: str) -> None:
    before = set(cluster_pids())
    started = time.monotonic()
    with pytest.raises(UsageError, match="positive, finite number of seconds"):
        shell.run_line_magic("axon_cluster", f"2 {flag} {value}")
    assert time.monotonic() - started < 1.0
    assert set(cluster_pids()) <= before


def test_missing_gpus_are_refused_before_launching() -> None:
    before = set(cluster_pids())
    started = time.monotonic()
    with pytest.raises(axon_nb.ClusterStartError, match=r"cuda:7, cuda:8, which this host lacks"):
        axon_nb.Cluster(n=2, gpus=[7, 8]).start()
    assert time.monotonic() - started < 1.0
    assert set(cluster_pids()) <= before


def test_more_ranks_than_cores_need_oversubscribe(shell, monkeypatch) -> None:
    monkeypatch.delenv("AXON_NB_OVERSUBSCRIBE", raising=False)
    before = set(cluster_pids())
    cores = len(psutil.Process().cpu_affinity() or [])
    with pytest.raises(axon_nb.ClusterStartError, match="pass --oversubscribe"):
        shell.run_line_magic("axon_cluster", str(cores + 1))
    with pytest.raises(axon_nb.ClusterStartError, match="GiB free: start at most"):
        axon_nb.Cluster(n=100_000, oversubscribe=True).start()
    assert set(cluster_pids()) <= before


@pytest.mark.parametrize(
    ("line", "message"),
    [("'unbalanced", "close the quotes"), ("--verbose train.py", "has no option '--verbose'")],
)
def test_axon_run_refuses_bad_command_lines(shell, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("axon_run", line)
