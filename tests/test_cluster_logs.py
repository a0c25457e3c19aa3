"""Clusters' log files: the oldest go once there are more than ``KEEP``, but never the log of a
cluster that may still run (an idle cluster writes nothing, so its log can be the oldest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from axon_nb.cluster import logs


def _log_of(directory: Path, pid: int, age_s: int) -> Path:
    """A log file named as ``ClusterLog.create`` names them, ``age_s`` seconds old."""
    path = directory / f"cluster-20261126-000000-{pid}-{age_s}.log"
    path.write_text("engine 0 registered\n")
    mtime = path.stat().st_mtime - age_s
    os.utime(path, (mtime, mtime))
    return path


def _pid_of_an_ended_process() -> int:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return int(ended.stdout)


def test_logs_of_running_clusters_are_never_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(logs, "KEEP", 3)
    directory = logs.log_dir()
    dead = _pid_of_an_ended_process()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = logs.ClusterLog.create()  # this process's, not stopped: the oldest of all
        os.utime(running.path, (1, 1))
        stopped = logs.ClusterLog.create()
        stopped.close()
        os.utime(stopped.path, (2, 2))
        other = _log_of(directory, alive.pid, 500)  # another kernel, still alive
        for age in (400, 300, 200):  # a kernel that exited
            _log_of(directory, dead, age)
        newest = logs.ClusterLog.create()  # prunes down to KEEP - 1 = 2 others where it can
        # 6 older logs, KEEP 3: the four oldest that belong to no running cluster go (the
        # stopped one of this process and the three of a kernel that exited)
        assert set(directory.glob("cluster-*.log")) == {running.path, other, newest.path}
        running.close()
        newest.close()
    finally:
        alive.kill()
        alive.wait()


def test_a_log_removed_by_another_kernel_while_pruning_does_not_fail_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kernel that starts a cluster prunes the same directory, so a log listed by one can
    be removed by another before the first reads its age (seen in CI: a start failed with
    FileNotFoundError from ``stat``). A link to a file that is gone is such a log: listed, but
    without an age."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(logs, "KEEP", 1)
    directory = logs.log_dir()
    dead = _pid_of_an_ended_process()
    gone = directory / f"cluster-20261126-000000-{dead}-1.log"
    gone.symlink_to(directory / "removed-by-another-kernel.log")
    old = _log_of(directory, dead, 100)
    created = logs.ClusterLog.create()
    created.close()
    assert created.path.exists()
    assert not old.exists()  # pruning went on past the vanished one


def test_an_error_shows_a_ranks_crash_report_from_its_first_line(tmp_path: Path) -> None:
    """A rank that crashed in native code left Python's crash report (about 40 lines, the
    frame that crashed near the top): an error shows it from its first line, not the last 15
    lines of it, and the log's last lines after it; without one, the last 15 lines."""
    path = tmp_path / "cluster.log"
    frames = [f'  File "lib{i}.py", line {i} in frame_{i}' for i in range(35)]
    before = [f"engine line {i}" for i in range(30)]
    crash = ["Fatal Python error: Segmentation fault", "", "Current thread 0x1 (most recent "
             "call first):", '  File "/x/model.py", line 7 in my_kernel', *frames]  # fmt: skip
    after = ["axon_nb: the engine of this rank (pid 12) was killed by signal 11 (SIGSEGV)"]
    path.write_text("\n".join([*before, *crash, *after]) + "\n")
    log = logs.ClusterLog(path)
    try:
        shown = log.ending().splitlines()
        assert shown[0] == f"The cluster's log ({path}) ends:"
        assert shown[1] == "Fatal Python error: Segmentation fault"
        assert "in my_kernel" in shown[3] and shown[-1] == after[0]
        # a report longer than an error shows: its start, a gap, and the log's last lines
        frames = [f'  File "lib{i}.py", line {i} in frame_{i}' for i in range(100)]
        path.write_text("\n".join([*before, *crash[:4], *frames, *after]) + "\n")
        shown = log.ending().splitlines()[1:]
        assert shown[0] == crash[0] and len(shown) == logs.CRASH_LINES + 1 + 15
        assert shown[logs.CRASH_LINES] == "..." and shown[-15:] == [*frames[-14:], *after]
        path.write_text("\n".join(before) + "\n")
        assert log.ending().splitlines()[1:] == before[-15:]
    finally:
        log.close()


CRASH = """
import ctypes, os
from axon_nb.rank.world.engine import report_crashes
report_crashes()
read_end, write_end = os.pipe()
os.dup2(write_end, 2)  # what ipykernel's output stream does to descriptor 2
def crash_here():
    ctypes.string_at(0)
crash_here()
"""


def test_a_ranks_crash_report_goes_to_its_log_after_ipykernel_took_its_stderr() -> None:
    """An engine's stderr is the cluster's log when it starts; ipykernel then puts a pipe on
    descriptor 2, read by a thread that dies with the crash. The report goes to the log."""
    crashed = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert crashed.returncode == -11
    assert "Fatal Python error: Segmentation fault" in crashed.stderr
    assert "in crash_here" in crashed.stderr
