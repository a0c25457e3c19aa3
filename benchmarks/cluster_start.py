"""Start-up: 2 local ranks ready for a first `%%axon` cell, against `python -c "import torch"`.

Both are measured alternately in the same run (the machine is noisy). Each start is broken
down into its phases, timed where the kernel waits for them:

- controller: ipyparallel's controller process up and its connection files written;
- engines launched: `mpiexec` started (the engines import ipyparallel, and torch on a side
  thread, from here on);
- engines connected: every engine registered and seen by the controller's heartbeat;
- world joined: every rank bound to its device and in `init_process_group`;
- first cell: a `%%axon` cell with one all-reduce.

The last line is the ratio of medians (start-up / import torch). Target: <= 2.0.

    python benchmarks/cluster_start.py [--ranks 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
from IPython.core.interactiveshell import InteractiveShell

from axon_nb.cluster import startup

PHASES = ["controller", "engines launched", "engines connected", "world joined", "first cell"]


class Clock:
    """Marks the end of each phase, from the start of `%axon_cluster`."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.start = 0.0

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            self.marks[phase] = time.perf_counter()
            return value

        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            value = await original(*args, **kwargs)
            self.marks[phase] = time.perf_counter()
            return value

        setattr(owner, name, timed_async if inspect.iscoroutinefunction(original) else timed)

    def phases(self) -> dict[str, float]:
        times, last = {}, self.start
        for phase in PHASES:
            times[phase] = self.marks[phase] - last
            last = self.marks[phase]
        return times


def start_once(shell: InteractiveShell, n: int, clock: Clock) -> float:
    clock.marks = {}
    clock.start = time.perf_counter()
    shell.run_line_magic("axon_cluster", str(n))
    cell = "import torch\nt = torch.ones(1)\ntorch.distributed.all_reduce(t)"
    shell.run_cell_magic("axon", "--no-stream", cell)
    clock.marks["first cell"] = time.perf_counter()
    elapsed = clock.marks["first cell"] - clock.start
    shell.run_line_magic("axon_cluster", "--stop")
    return elapsed


def import_torch() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    clock = Clock()
    clock.wrap(ipp.Cluster, "start_controller", "controller")
    clock.wrap(ipp.Cluster, "start_engines", "engines launched")
    clock.wrap(startup, "wait_for_engines", "engines connected")
    clock.wrap(startup, "join_world", "world joined")
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("axon_nb")
    ours, torch_times = [], []
    phases: dict[str, list[float]] = defaultdict(list)
    for i in range(args.repeats):
        # alternate who goes first, so neither always gets the warmer caches
        pair = [("start", lambda: start_once(shell, args.ranks, clock)), ("torch", import_torch)]
        for name, run in pair if i % 2 == 0 else pair[::-1]:
            seconds = run()
            (ours if name == "start" else torch_times).append(seconds)
            if name == "start":
                for phase, t in clock.phases().items():
                    phases[phase].append(t)
            print(f"run {i} {name:5s} {seconds:6.2f} s", flush=True)
    print(f"\nstart-up of {args.ranks} ranks, median of {args.repeats}:")
    for phase in PHASES:
        print(f"  {phase:18s} {statistics.median(phases[phase]):5.2f} s")
    a, b = statistics.median(ours), statistics.median(torch_times)
    print(f"start-up median {a:.2f} s (min {min(ours):.2f}, max {max(ours):.2f}); "
          f"`python -c 'import torch'` median {b:.2f} s")  # fmt: skip
    print(f"ratio start-up/import torch: {a / b:.3f}")


if __name__ == "__main__":
    main()
