"""Round trip of a ``%%axon`` cell and of ``cluster.run`` against raw ipyparallel ``apply_sync``.

One 2-rank cluster, started with ``%axon_cluster 2`` in a real IPython shell. Round-robin over
the repetitions it times (a) a ``%%axon`` cell that assigns a variable, (b) ``cluster.run`` of a
trivial function and (c) ``apply_sync`` of that function on the same engines through the
cluster's own ipyparallel client (the reference). For context it also times raw ipyparallel
``execute`` of the cell's code (what ``%%axon`` sends; the engines run it through IPython, which
costs more than ``apply``). Prints the median of each in ms, the ratios to (c) and, last, the
worst of (a)/(c) and (b)/(c). Target: <= 1.5.

    python benchmarks/cell_latency.py [--ranks 2] [--repeats 200] [--warmup 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from IPython.core.interactiveshell import InteractiveShell

import axon_nb

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU host

CELL = "x = rank"


def noop() -> None:
    return None


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200, help="round trips of each kind")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips of each")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("axon_nb")
    shell.run_line_magic("axon_cluster", str(args.ranks))
    cluster = axon_nb.current_cluster()
    try:
        engines = cluster.client[:]
        kinds: dict[str, Callable[[], object]] = {
            "%%axon cell": lambda: shell.run_cell_magic("axon", "", CELL),
            "cluster.run": lambda: cluster.run(noop),
            "raw apply_sync": lambda: engines.apply_sync(noop),
            "raw execute": lambda: engines.execute(CELL, silent=False, block=True),
        }
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for i in range(args.warmup + args.repeats):
            # rotate who goes first, so none always follows the same one
            names = list(kinds)[i % len(kinds) :] + list(kinds)[: i % len(kinds)]
            for name in names:
                ms = timed(kinds[name])
                if i >= args.warmup:
                    times[name].append(ms)
    finally:
        shell.run_line_magic("axon_cluster", "--stop")
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    for name, ms in times.items():
        p90 = statistics.quantiles(ms, n=10)[-1]
        print(f"{name:14s} median {medians[name]:6.2f} ms, p90 {p90:6.2f} ms ({len(ms)} runs)")
    reference = medians["raw apply_sync"]
    ratios = {name: medians[name] / reference for name in ("%%axon cell", "cluster.run")}
    print(f"(raw execute / raw apply_sync: {medians['raw execute'] / reference:.2f})")
    for name, ratio in ratios.items():
        print(f"{name} / raw apply_sync: {ratio:.2f}")
    print(f"worst ratio (axon / raw apply_sync): {max(ratios.values()):.2f}")


if __name__ == "__main__":
    main()
