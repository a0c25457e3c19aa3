"""Start-up: 2 local ranks ready for a first `%%axon` cell, against `python -c "import torch"`.

Both are measured alternately in the same run (the machine is noisy). Each start is broken
down into its phases, timed where the kernel waits for them:

- controller: ipyparallel's controller process up and its connection files written;
- engines launched: `mpiexec` started (from here on each rank's parent asks the warm
  process, ``cluster/warm_engines.py``, to fork its engine; on a first start that process
  imports torch meanwhile, once for all ranks);
- engines connected: every engine registered and seen by the controller's heartbeat;
- world joined: every rank bound to its device and in `init_process_group`;
- first cell: a `%%axon` cell with one all-reduce.

Each repeat runs in a new process, like a new kernel: its first start (the warm process starts
with it), then ``%axon_cluster --restart``, timed from its ``Cluster.start`` (after the old
ranks' stop), whose engines are forked from the warm process as it was left.

The last line is the ratio of medians (first start / import torch). Target: <= 2.0.

    python benchmarks/cluster_start.py [--ranks 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
from IPython.core.interactiveshell import InteractiveShell

from axon_nb.cluster import startup
from axon_nb.cluster.cluster import Cluster

PHASES = ["controller", "engines launched", "engines connected", "world joined", "first cell"]


class Clock:
    """Marks the end of each phase, from the start of `%axon_cluster`."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.start = 0.0

    def starts_at(self, owner: Any, name: str) -> None:
        """Start the clock as ``owner.name`` is called."""
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.start = time.perf_counter()
            return original(*args, **kwargs)

        setattr(owner, name, timed)

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


def start_once(shell: InteractiveShell, line: str, clock: Clock) -> float:
    """``%axon_cluster LINE`` (a start, or ``--restart``), then a first cell: the seconds from
    ``Cluster.start`` (a restart's stop of the old ranks comes before it) to the cell's end."""
    clock.marks = {}
    shell.run_line_magic("axon_cluster", line)
    cell = "import torch\nt = torch.ones(1)\ntorch.distributed.all_reduce(t)"
    shell.run_cell_magic("axon", "--no-stream", cell)
    clock.marks["first cell"] = time.perf_counter()
    return clock.marks["first cell"] - clock.start


def import_torch() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def kernel(n: int) -> None:
    """(In a new process) a first start, then a restart, whose engines are forked from the
    warm process; their phases as one JSON line."""
    clock = Clock()
    clock.starts_at(Cluster, "start")
    clock.wrap(ipp.Cluster, "start_controller", "controller")
    clock.wrap(ipp.Cluster, "start_engines", "engines launched")
    clock.wrap(startup, "wait_for_engines", "engines connected")
    clock.wrap(startup, "join_world", "world joined")
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("axon_nb")
    starts = []
    for line in (str(n), "--restart"):
        seconds = start_once(shell, line, clock)
        starts.append({"seconds": seconds, **clock.phases()})
    shell.run_line_magic("axon_cluster", "--stop")
    print(json.dumps(starts), flush=True)


def new_kernel(n: int) -> list[dict[str, float]]:
    out = subprocess.run(
        [sys.executable, __file__, "--kernel", str(n)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kernel", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernel:
        kernel(args.kernel)
        return
    cold: list[dict[str, float]] = []
    warm: list[dict[str, float]] = []
    torch_times: list[float] = []
    for i in range(args.repeats):
        # alternate who goes first, so neither always gets the warmer caches
        pair = ["start", "torch"] if i % 2 == 0 else ["torch", "start"]
        for name in pair:
            if name == "torch":
                torch_times.append(import_torch())
                print(f"run {i} import torch {torch_times[-1]:6.2f} s", flush=True)
            else:
                first, second = new_kernel(args.ranks)
                cold.append(first)
                warm.append(second)
                print(f"run {i} first start {first['seconds']:6.2f} s, "
                      f"restart's start {second['seconds']:6.2f} s", flush=True)  # fmt: skip
    for label, starts in (("restart's start (warm engines)", warm), ("first start", cold)):
        print(f"\n{label} of {args.ranks} ranks, median of {args.repeats}:")
        for phase in PHASES:
            print(f"  {phase:18s} {statistics.median(s[phase] for s in starts):5.2f} s")
    w = statistics.median(s["seconds"] for s in warm)
    a = statistics.median(s["seconds"] for s in cold)
    b = statistics.median(torch_times)
    firsts = [s["seconds"] for s in cold]
    print(f"\nrestart's start median {w:.2f} s; first start median {a:.2f} s "
          f"(min {min(firsts):.2f}, max {max(firsts):.2f}); "
          f"`python -c 'import torch'` median {b:.2f} s")  # fmt: skip
    print(f"ratio restart's start/import torch: {w / b:.3f}")
    print(f"ratio first start/import torch: {a / b:.3f}")


if __name__ == "__main__":
    main()
