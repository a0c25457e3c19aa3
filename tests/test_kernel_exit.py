"""A kernel that ends, however it ends, takes every rank process with it: a real Jupyter
kernel (and a plain script for `sys.exit`), ranks training or busy in a cell."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import wait_gone
from kernel_client import run_cell

from axon_nb.notebooks import start_kernel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

START = "import axon_nb, busy\ncluster = axon_nb.Cluster(n=2, timeout=60).start()"
BUSY = {
    "train": "run = busy.train_forever(cluster)",
    "sleep": "cluster.run(busy.sleep_in_cell)",  # (the cell is still running at the end)
}


def _descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize(
    ("ending", "busy", "limit"),
    [
        ("exit", "train", 10.0),  # `exit` in a cell: the kernel shuts down normally
        ("restart", "train", 10.0),  # Jupyter's restart: shutdown request, SIGTERM, SIGKILL
        # (a busy kernel may outlast Jupyter's shutdown wait, and then ends as SIGKILL's does)
        ("restart", "sleep", 15.0),
        ("sigkill", "sleep", 15.0),
    ],
)
def test_kernel_end_takes_every_rank_with_it(ending: str, busy: str, limit: float) -> None:
    km, kc = start_kernel()
    try:
        assert run_cell(kc, START)[0] == "ok"
        kernel_pid = km.provisioner.pid
        if busy == "sleep":
            kc.execute(BUSY[busy])
        else:
            assert run_cell(kc, BUSY[busy])[0] == "ok"
        time.sleep(2)
        pids = _descendants(kernel_pid)
        assert len(pids) >= 8
        started = time.monotonic()
        if ending == "exit":
            kc.execute("exit")
        elif ending == "restart":
            km.restart_kernel(now=False)
        else:
            os.kill(kernel_pid, signal.SIGKILL)
        assert wait_gone(pids, seconds=limit + 5) == []
        assert time.monotonic() - started < limit
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


SCRIPT = textwrap.dedent(
    """
    import sys, time
    import axon_nb, busy

    cluster = axon_nb.Cluster(n=2, timeout=60).start()
    cluster.send(busy.sleep_in_cell)
    time.sleep(1.5)
    print("busy", flush=True)
    time.sleep(1.0)
    sys.exit(3)  # while the ranks still sleep in their cell
    """
)


def test_sys_exit_while_ranks_are_busy_ends_them(tmp_path: Path) -> None:
    script = tmp_path / "starter.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "exit"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "busy"
        pids = _descendants(proc.pid)
        assert len(pids) >= 8
        started = time.monotonic()
        assert proc.wait(timeout=30) == 3
        assert wait_gone(pids, seconds=15) == []
        assert time.monotonic() - started < 10.0
    finally:
        proc.kill()
