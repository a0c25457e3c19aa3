"""The CPU a start costs, with engines forked from the kernel's warm process against engines
started as new processes (``cluster/warm_engines.py``; ``AXON_NB_WARM_ENGINES=0``).

A rank's engine spends most of its start importing torch (and ipyparallel, and axon_nb's rank
modules). The warm process imports them once for all ranks; each engine is forked from it.
Each row is ``Cluster(n=2).start()``, one cell and ``stop()``, alternating in the same run:

- plain: each engine a new process;
- first: forked engines, the warm process started with the cluster and ended by its stop (a
  kernel's first start);
- warm: forked engines, from a warm process that was already running and stays (what a
  restart or recovery gets: ``stop(keep_warm=True)``).

A row's CPU is this process's and everything it waited for, plus the warm process's and the
engines it reaped. The last lines are the ratios of medians against plain.

    python benchmarks/forked_engines.py [--ranks 2] [--repeats 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import axon_nb
from axon_nb.cluster import warm_engines
from axon_nb.spec.warm_engines import SWITCH_ENV


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of the children it has waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _settled(pid: int) -> None:
    """Wait until ``pid`` has used (almost) no CPU for a second: the warm process has imported."""
    last = -1.0
    while (now := _cpu_s(pid)) - last > 0.05:
        last = now
        time.sleep(1.0)


def _row(ranks: int, switch: str, keep_warm: bool, server: int | None) -> float:
    os.environ[SWITCH_ENV] = switch
    before = _cpu_s(os.getpid()) + (_cpu_s(server) if server else 0.0)
    cluster = axon_nb.Cluster(n=ranks, oversubscribe=True).start()
    assert cluster.run(lambda: 1, stream=False) == [1] * ranks
    cluster.stop(keep_warm=keep_warm)
    time.sleep(1.0)  # the warm process reaps its engines
    return _cpu_s(os.getpid()) + (_cpu_s(server) if server else 0.0) - before


def measure(ranks: int, repeats: int) -> None:
    rows: dict[str, list[float]] = {"plain": [], "warm": [], "first": []}
    for _ in range(repeats):
        for name in rows:
            server = None
            if name == "warm":  # started, and done importing, before the row
                os.environ[SWITCH_ENV] = "1"
                warm_engines.server_directory()
                server = warm_engines.server_pid()
                assert server is not None, "the warm process did not start"
                _settled(server)
            switch = "0" if name == "plain" else "1"
            cpu = _row(ranks, switch, keep_warm=name == "warm", server=server)
            if name == "warm":
                warm_engines.stop_if_idle()
            rows[name].append(cpu)
            print(f"{name:6s} start, one cell, stop: {cpu:.2f} CPU-s", flush=True)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(f"\n{ranks} ranks, median of {repeats}: " + ", ".join(
        f"{name} {value:.2f} CPU-s" for name, value in medians.items()
    ))  # fmt: skip
    print(f"ratio first/plain: {medians['first'] / medians['plain']:.3f}")
    print(f"ratio warm/plain: {medians['warm'] / medians['plain']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    options = parser.parse_args()
    measure(options.ranks, options.repeats)


if __name__ == "__main__":
    main()
