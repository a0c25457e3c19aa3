"""The CPU a start costs, with engines forked from the kernel's warm process against engines
started as new processes (``cluster/warm_engines.py``; ``AXON_NB_WARM_ENGINES=0``).

A rank's engine spends most of its start importing torch (and ipyparallel, and axon_nb's rank
modules). The warm process has imported them once; each start's engines are forked from it.
Alternating in the same run:

- plain: ``Cluster(n=2).start()``, one cell, ``stop()``, each engine a new process;
- forked: the same, each engine forked from the warm process.

Each row is the CPU of this process and everything it waited for, plus the warm process and
the engines it forked and reaped (its own imports, done before the first row, excluded). The
last line is the ratio of medians (forked / plain).

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


def measure(ranks: int, repeats: int) -> None:
    os.environ[SWITCH_ENV] = "1"
    warm_engines.server_directory()
    server = warm_engines.server_pid()
    assert server is not None, "the warm process did not start"
    _settled(server)
    rows: dict[str, list[float]] = {"plain": [], "forked": []}
    for _ in range(repeats):
        for name in rows:
            os.environ[SWITCH_ENV] = "0" if name == "plain" else "1"
            before = _cpu_s(os.getpid()) + _cpu_s(server)
            with axon_nb.Cluster(n=ranks, oversubscribe=True) as cluster:
                assert cluster.run(lambda: 1, stream=False) == [1] * ranks
            time.sleep(1.0)  # the warm process reaps its engines
            cpu = _cpu_s(os.getpid()) + _cpu_s(server) - before
            rows[name].append(cpu)
            print(f"{name:7s} start, one cell, stop: {cpu:.2f} CPU-s", flush=True)
    plain, forked = (statistics.median(rows[name]) for name in ("plain", "forked"))
    print(f"\n{ranks} ranks, median of {repeats}: plain {plain:.2f} CPU-s, forked {forked:.2f}")
    print(f"ratio forked/plain: {forked / plain:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    options = parser.parse_args()
    measure(options.ranks, options.repeats)


if __name__ == "__main__":
    main()
