"""Stop a cluster once the process that started it is gone, even if it was SIGKILLed.

ipyparallel stops clusters from ``atexit``, which a killed kernel never runs. This watcher is
started in its own session beside every cluster and lives only as long as the cluster file.

Usage: ``python -m axon_nb.cluster.reaper PARENT_PID CLUSTER_FILE [WATCH_DIR]``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil

POLL_S = 0.5


def spawn(parent_pid: int, cluster_file: str, watch_dir: str) -> subprocess.Popen[bytes]:
    """Start the watcher for ``cluster_file`` in a new session (so kernel signals miss it);
    it removes the cluster's ``watch_dir`` (``hangs.WatchDir``) when the cluster is gone."""
    return subprocess.Popen(
        [sys.executable, "-m", "axon_nb.cluster.reaper", str(parent_pid), cluster_file, watch_dir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(parent_pid: int, cluster_file: str) -> bool:
    """Block until the cluster is stopped normally (False) or its parent dies (True)."""
    while os.path.exists(cluster_file):
        if not alive(parent_pid):
            return True
        time.sleep(POLL_S)
    return False


def main(argv: list[str]) -> int:
    parent_pid, cluster_file = int(argv[0]), argv[1]
    try:
        if watch(parent_pid, cluster_file):
            import ipyparallel as ipp

            from axon_nb.cluster.startup import read_output

            cluster = ipp.Cluster.from_file(cluster_file)
            for launcher in [*cluster.engines.values(), cluster.controller]:
                if launcher is not None:
                    read_output(launcher)  # (ipyparallel's strict UTF-8 read fails on some)
            cluster.stop_cluster_sync()
    finally:  # (ipyparallel's atexit stops a cluster, but knows nothing of this directory)
        if len(argv) > 2:
            shutil.rmtree(argv[2], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
