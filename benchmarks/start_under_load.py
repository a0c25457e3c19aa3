"""Clusters started and stopped in a row while a CPU hog keeps every core busy.

The "only 0 of N engines connected" failure came from ipyparallel's 5 s registration timeout:
on a loaded machine the controller (then eight processes, busy starting) answered an engine's
registration later than that, and the engine gave up. `--engine-timeout 5` puts that timeout
back, and `--ipyparallel-defaults` ipyparallel's controller too (eight processes, 3 s
heartbeat), to see the failure again. Prints each start and last `started/tried`.

    python benchmarks/start_under_load.py --count 50 [--hogs 4] [--ipyparallel-defaults]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import axon_nb
from axon_nb.cluster import launchers


def _hog(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def start_many(count: int, *, hogs: int, ranks: int = 2, log: bool = True) -> int:
    """Start and stop ``count`` clusters of ``ranks`` beside ``hogs`` busy processes; how many
    started."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True) for _ in range(hogs)]
    for proc in procs:
        proc.start()
    started = 0
    try:
        for i in range(count):
            began = time.monotonic()
            try:
                with axon_nb.Cluster(n=ranks, timeout=60, start_timeout=120) as cluster:
                    assert cluster.run(lambda: 1, stream=False) == [1] * ranks
                started += 1
                outcome = "started"
            except axon_nb.ClusterStartError as e:
                outcome = f"FAILED: {e}"  # with the end of the cluster's log
            if log:
                print(f"{i + 1:3d} {outcome} ({time.monotonic() - began:.1f} s)", flush=True)
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=5)
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--hogs", type=int, default=4)
    parser.add_argument("--ipyparallel-defaults", action="store_true")
    args = parser.parse_args()
    if args.ipyparallel_defaults:
        launchers.ENGINE_ARGS[:] = []
        launchers.CONTROLLER_ARGS[:] = []
    started = start_many(args.count, hogs=args.hogs)
    print(f"started/tried: {started}/{args.count}")


if __name__ == "__main__":
    main()
