"""Round trip of a ``%%axon`` cell and of ``cluster.run`` as the ranks grow, against raw
ipyparallel ``apply_sync``.

For each size of ``--ranks`` (2 4 8 by default; more ranks than cores are oversubscribed) one
cluster is started with ``%axon_cluster N --oversubscribe`` in a real IPython shell. Round-robin
over the repetitions it times (a) a ``%%axon`` cell that assigns a variable, (b)
``cluster.run`` of a trivial function and (c) ``apply_sync`` of that function on the same
engines through the cluster's own ipyparallel client (the reference), each by wall clock and by
the kernel process's CPU time (all its threads: what one call costs the notebook), in two
rounds: wall clock with the calls back to back, CPU time with each call followed by a quiet
``SETTLE_S`` counted to it, so that a call's CPU time includes its messages that arrive after
it returned (a status, an acknowledgement) and none pays for the one before. Prints per
size the medians (ms) and the CPU ms per call, then the largest size over the smallest: wall
and kernel CPU, for (a) and (b). Targets (issue 47, on a 2-core machine): 8/2 wall <= 2.0 and
8/2 kernel CPU per call <= 2.0.

    python benchmarks/cell_latency.py [--ranks 2 4 8] [--repeats 100] [--warmup 10]
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
KINDS = ("%%axon cell", "cluster.run", "raw apply_sync")
SETTLE_S = 0.02
"""Quiet time after each call, for its late messages (its CPU counts, its wall time not)."""


def noop() -> None:
    return None


def wall_ms(call: Callable[[], object]) -> float:
    """Wall-clock milliseconds of one call."""
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def cpu_ms(call: Callable[[], object]) -> float:
    """The kernel's CPU milliseconds for one call, ``SETTLE_S`` after it included."""
    start = time.process_time()
    call()
    time.sleep(SETTLE_S)
    return (time.process_time() - start) * 1e3


def rounds(kinds: dict[str, Callable[[], object]], measure: Callable[[Callable[[], object]], float],
           repeats: int, warmup: int) -> dict[str, list[float]]:  # fmt: skip
    """``measure`` of each kind, ``repeats`` times after ``warmup``, who goes first rotating
    (so that none always follows the same one)."""
    figures: dict[str, list[float]] = {name: [] for name in kinds}
    for i in range(warmup + repeats):
        names = list(kinds)[i % len(kinds) :] + list(kinds)[: i % len(kinds)]
        for name in names:
            figure = measure(kinds[name])
            if i >= warmup:
                figures[name].append(figure)
    return figures


def measure(shell: InteractiveShell, ranks: int, repeats: int, warmup: int) -> dict[str, tuple]:
    """Per kind: (median wall ms, p90 wall ms, median kernel CPU ms) on ``ranks`` ranks."""
    shell.run_line_magic("axon_cluster", f"{ranks} --oversubscribe")
    cluster = axon_nb.current_cluster()
    try:
        engines = cluster.client[:]
        kinds: dict[str, Callable[[], object]] = {
            "%%axon cell": lambda: shell.run_cell_magic("axon", "", CELL),
            "cluster.run": lambda: cluster.run(noop),
            "raw apply_sync": lambda: engines.apply_sync(noop),
        }
        walls = rounds(kinds, wall_ms, repeats, warmup)
        cpus = rounds(kinds, cpu_ms, repeats, warmup)
    finally:
        shell.run_line_magic("axon_cluster", "--stop")
    return {
        name: (statistics.median(walls[name]), statistics.quantiles(walls[name], n=10)[-1],
               statistics.median(cpus[name]))
        for name in kinds
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=100, help="round trips of each kind")
    parser.add_argument("--warmup", type=int, default=10, help="untimed round trips of each")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("axon_nb")
    figures = {}
    for ranks in args.ranks:
        figures[ranks] = measure(shell, ranks, args.repeats, args.warmup)
        for name, (median, p90, cpu) in figures[ranks].items():
            print(f"{ranks} ranks  {name:14s} median {median:6.2f} ms, p90 {p90:6.2f} ms, "
                  f"kernel CPU {cpu:5.2f} ms per call", flush=True)  # fmt: skip
    small, large = min(figures), max(figures)
    for name in KINDS:
        wall = figures[large][name][0] / figures[small][name][0]
        cpu = figures[large][name][2] / figures[small][name][2]
        print(f"{name} {large}/{small} ranks: wall {wall:.2f}, kernel CPU per call {cpu:.2f}")


if __name__ == "__main__":
    main()
