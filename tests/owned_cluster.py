"""A cluster of another user's, for security tests: run as that user, it starts a 2-rank
cluster with dask, says where it is, keeps its ranks printing and publishing a marker while a
stranger probes it, and stops on request.

Lines on stdin: ``busy SECONDS`` (ranks print and publish the marker that long, from a
thread), ``check`` (answers ``ok`` once the ranks still run code), ``stop``. It answers
each with one line on stdout: ``ANSWER`` and JSON.
"""

from __future__ import annotations

import json
import sys

from other_users import print_marker

import axon_nb

MARKER = "axon-secret-marker-7f3a"
PREFIX = "ANSWER "
"""Starts each answer line (what the cluster prints itself goes to stdout too)."""


def _answer(data: dict) -> None:
    print(PREFIX + json.dumps(data), flush=True)


def main() -> None:
    cluster = axon_nb.Cluster(n=2, timeout=60).start()
    client = cluster.dask()
    answer = {
        "ranks": [r["pid"] for r in cluster.ranks],
        "dask": client.scheduler.address,
        "private_dir": str(cluster._watch.path),
        "cluster_file": cluster._ipp.cluster_file,
        "marker": MARKER,
    }
    _answer(answer)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "busy":
            seconds = float(args[0])
            cluster.run(print_marker, MARKER, seconds, stream=False)
            _answer({"busy": seconds})
        elif command == "check":
            ok = cluster.run(lambda: 1, stream=False) == [1, 1]
            ok = ok and client.submit(sum, [1, 2]).result(timeout=30) == 3
            _answer({"ok": ok})
        elif command == "stop":
            break
    cluster.stop()
    _answer({"stopped": True})


if __name__ == "__main__":
    main()
