"""Clusters started and stopped in a row while a CPU hog keeps every core busy.

The "only 0 of N engines connected" failure came from ipyparallel's 5 s registration timeout:
on a loaded machine the controller (then eight processes, busy starting) answered an engine's
registration later than that, and the engine gave up. `--engine-timeout 5` puts that timeout
back, and `--ipyparallel-defaults` ipyparallel's controller too (eight processes, 3 s
heartbeat), to see the failure again. Prints each start and last `started/tried`.

    python benchmarks/start_under_load.py --count 50 [--hogs 4] [--warm-every 2] \
        [--ipyparallel-defaults]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import axon_nb
from axon_nb.cluster import launchers, warm_engines


def _hog(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def start_many(
    count: int, *, hogs: int, ranks: int = 2, log: bool = True, warm_every: int = 0
) -> int:
    """Start and stop ``count`` clusters of ``ranks`` beside ``hogs`` busy processes; how many
    started. With ``warm_every=k``, every k-th stop keeps the warm process, so that the next
    start forks its engines at once (as ``%axon_cluster --restart`` does); the others end it,
    and the next start's engines wait for a new one to import torch."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True) for _ in range(hogs)]
    for proc in procs:
        proc.start()
    started = 0
    try:
        for i in range(count):
            began = time.monotonic()
            keep_warm = warm_every > 0 and (i + 1) % warm_every == 0
            try:
                cluster = axon_nb.Cluster(n=ranks, timeout=60, start_timeout=120).start()
                try:
                    assert cluster.run(lambda: 1, stream=False) == [1] * ranks
                finally:
                    cluster.stop(keep_warm=keep_warm)
                started += 1
                outcome = "started" + (" (warm kept)" if keep_warm else "")
            except axon_nb.ClusterStartError as e:
                outcome = f"FAILED: {e}"  # with the end of the cluster's log
            if log:
                print(f"{i + 1:3d} {outcome} ({time.monotonic() - began:.1f} s)", flush=True)
    finally:
        warm_engines.stop_if_idle()  # (the last stop may have kept it)
        stop.set()
        for proc in procs:
            proc.join(timeout=5)
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--hogs", type=int, default=4)
    parser.add_argument(
        "--warm-every", type=int, default=0, help="keep the warm process at every k-th stop"
    )
    parser.add_argument("--ipyparallel-defaults", action="store_true")
    args = parser.parse_args()
    if args.ipyparallel_defaults:
        launchers.ENGINE_ARGS[:] = []
        launchers.CONTROLLER_ARGS[:] = []
    started = start_many(args.count, hogs=args.hogs, warm_every=args.warm_every)
    print(f"started/tried: {started}/{args.count}")


if __name__ == "__main__":
    main()
