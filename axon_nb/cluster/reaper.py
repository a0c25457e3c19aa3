"""Stop a cluster once the process that started it is gone, even if it was SIGKILLed.

ipyparallel stops clusters from ``atexit``, which a killed kernel never runs (nor one ended
by SIGTERM, as Jupyter's restart does after its shutdown request). This watcher is started in
its own session beside every cluster and lives only as long as the cluster file. When the
kernel dies it ends the cluster's processes with the SIGTERM and SIGKILL steps of
``axon_nb.spec.stop_waits`` (ranks busy or stuck included), then removes the cluster's files.

Usage: ``python -m axon_nb.cluster.reaper PARENT_PID CLUSTER_FILE WATCH_DIR PID[,PID...]``
(the PIDs: the controller and the engine launchers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

from axon_nb.cluster.stopping import alive, process_tree, terminate_then_kill
from axon_nb.spec.stop_waits import REAPER_POLL_S


def spawn(
    parent_pid: int, cluster_file: str, watch_dir: str, roots: list[int]
) -> subprocess.Popen[bytes]:
    """Start the watcher for ``cluster_file`` in a new session (so kernel signals miss it);
    it ends the processes under ``roots`` and removes the cluster's ``watch_dir``
    (``hangs.WatchDir``) when the kernel is gone."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "axon_nb.cluster.reaper",
            str(parent_pid),
            cluster_file,
            watch_dir,
            ",".join(map(str, roots)),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def dismiss(watcher: subprocess.Popen[bytes]) -> None:
    """End the watcher of a cluster that was stopped normally (its work is done; it would
    notice in its next poll)."""
    watcher.terminate()
    watcher.wait(timeout=10)


def watch(parent_pid: int, cluster_file: str) -> bool:
    """Block until the cluster is stopped normally (False) or its parent dies (True)."""
    while os.path.exists(cluster_file):
        if not alive(parent_pid):
            return True
        time.sleep(REAPER_POLL_S)
    return False


def main(argv: list[str]) -> int:
    parent_pid, cluster_file, watch_dir = int(argv[0]), argv[1], argv[2]
    roots = [int(p) for p in argv[3].split(",") if p] if len(argv) > 3 else []
    try:
        if watch(parent_pid, cluster_file):
            terminate_then_kill(process_tree(roots), roots)
            remove_files(cluster_file)
    finally:  # (ipyparallel's atexit stops a cluster, but knows nothing of this directory)
        shutil.rmtree(watch_dir, ignore_errors=True)
    return 0


def remove_files(cluster_file: str) -> None:
    """ipyparallel's own clean-up of a stopped cluster's files (its processes are gone)."""
    with contextlib.suppress(Exception):
        import ipyparallel as ipp

        cluster = ipp.Cluster.from_file(cluster_file)
        cluster.log.disabled = True
        cluster.stop_cluster_sync()
    with contextlib.suppress(OSError):
        os.remove(cluster_file)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
