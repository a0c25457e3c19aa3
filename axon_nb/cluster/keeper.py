"""The keeper of a detached cluster: the process that owns its lifetime once no kernel does.

A cluster started with ``detach=True`` has, instead of the kernel-bound guards (the reaper
watching the kernel, the ``atexit`` stop, the warm engine process), this process in its own
session. The cluster's reaper watches the keeper, so if the keeper dies, the ranks end (they
may hold GPUs); each rank also watches it (``rank/world/kept_runs.py::end_with``).

The keeper ends the cluster (its processes, ipyparallel's files, the cluster's directories)

- after ``idle_timeout`` seconds with no attached kernel (``attached/<pid>`` of a live
  process) and no run in progress (``spec/kept_runs.py``);
- on SIGTERM (``axon_nb.stop_detached``), if a kernel has not already stopped it;
- if the kernel that started it died before the cluster was up.

It exits when a kernel stopped the cluster (its record is gone).

Usage: ``python -m axon_nb.cluster.keeper ROOT KERNEL_PID CLUSTER_FILE WATCH_DIR PID[,PID...]
IDLE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from axon_nb.cluster import detached_registry, mpi_leftovers
from axon_nb.cluster.detached import attached, ranks_alive, read_record
from axon_nb.cluster.reaper import remove_files
from axon_nb.cluster.stopping import alive, process_tree, terminate_then_kill
from axon_nb.spec.kept_runs import KeptRun, kept_runs
from axon_nb.spec.signals import drain, wakeup_pipe

POLL_S = 1.0
"""How often the keeper looks at its cluster."""

_asked = False


def main(argv: list[str]) -> int:
    root, kernel_pid, cluster_file, watch_dir = Path(argv[0]), int(argv[1]), argv[2], argv[3]
    roots = [int(p) for p in argv[4].split(",") if p]
    idle_timeout = float(argv[5])
    signal.signal(signal.SIGTERM, _on_term)
    woken, _ = wakeup_pipe()
    idle_since: float | None = None
    while True:
        if not (root / "cluster.json").exists():
            detached_registry.remove(root.name)
            return 0  # a kernel stopped it (it removes the record first)
        try:
            why, idle_since = _look(root, kernel_pid, idle_timeout, idle_since)
        except Exception as e:  # (a file read mid-change: looked at again next time)
            print(f"could not look at the cluster: {e!r}", flush=True)
            why = None
        if why is not None:
            break
        _nap(woken, POLL_S)
    print(f"ending the cluster: {why}", flush=True)
    terminate_then_kill(process_tree(roots), roots)
    mpi_leftovers.remove_stale()  # (what its MPI job left in /dev/shm)
    detached_registry.remove(root.name)
    remove_files(cluster_file)
    shutil.rmtree(watch_dir, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _look(
    root: Path, kernel_pid: int, idle_timeout: float, idle_since: float | None
) -> tuple[str | None, float | None]:
    """Why the cluster should end now (None: it goes on), and since when it has been idle."""
    record = read_record(root)
    if record is None:
        return None, idle_since  # (being replaced this instant)
    if not record["ranks"]:  # still starting, in its kernel
        alive_kernel = alive(kernel_pid)
        return (None if alive_kernel and not _asked else "its start did not finish"), None
    runs, kernels = kept_runs(root, ranks_alive(record)), attached(root)  # (read once a look)
    if _sidebar(record, runs, kernels) == "stop_cluster":
        return "stopped from the sidebar", idle_since
    if _asked:
        return "asked to stop", idle_since
    busy = kernels or any(r.running for r in runs)
    idle_since = None if busy else idle_since or time.monotonic()
    if idle_since is not None and time.monotonic() - idle_since >= idle_timeout:
        return f"idle for {idle_timeout:g} s", idle_since
    return None, idle_since


def _sidebar(record: dict[str, Any], runs: list[KeptRun], kernels: list[int]) -> str | None:
    """Publish the cluster in JupyterLab's sidebar and carry out its control, if any."""
    try:
        detached_registry.publish(record, runs, kernels)
        action = detached_registry.take_control(record)
    except Exception as e:  # (the sidebar is a view: the cluster is kept either way)
        print(f"the sidebar entry could not be written: {e}", flush=True)
        return None
    if action in ("stop_run", "interrupt"):  # what Ctrl-C does: SIGINT to every rank
        for pid in record.get("pids", {}).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
    return action


def _nap(woken: int, seconds: float) -> None:
    """Sleep ``seconds``, or less if a signal comes (``woken``: ``wakeup_pipe``'s read end;
    a stopping kernel SIGTERMs this process and waits for it to exit)."""
    if select.select([woken], [], [], seconds)[0]:
        drain(woken)


def _on_term(signum: int, frame: FrameType | None) -> None:
    global _asked
    _asked = True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
