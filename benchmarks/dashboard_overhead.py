"""Training throughput with the dashboard streaming (default rate) against streaming off.

The same 2-rank DDP run (``ddp_workload``) alternates between ``metrics_interval_s=0.5`` (each
rank publishes, the kernel's monitor feeds the live dashboard widget) and ``0`` (no
publications); the first ``--warmup`` steps are left out. Prints samples/s of each and, last,
the ratio of medians (with / without). Target: >= 0.99.

    python benchmarks/dashboard_overhead.py [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU host
sys.path.insert(0, str(HERE))

import ddp_workload  # noqa: E402

import axon_nb  # noqa: E402


def run(cluster: axon_nb.Cluster, steps: int, warmup: int, interval: float) -> tuple[float, int]:
    """Samples/s after warm-up, and the dashboard's widget updates."""
    rate, result = ddp_workload.train_on_cluster(
        cluster, steps, warmup, metrics_interval_s=interval
    )
    return rate, result.dashboard.updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    streaming, off = [], []
    with axon_nb.Cluster(n=2) as cluster:
        for i in range(args.repeats):
            rate, updates = run(cluster, args.steps, args.warmup, 0.5)
            streaming.append(rate)
            off.append(run(cluster, args.steps, args.warmup, 0.0)[0])
            print(
                f"run {i + 1}: streaming {streaming[-1]:.1f} samples/s ({updates} widget "
                f"updates), off {off[-1]:.1f}"
            )
    a, b = statistics.median(streaming), statistics.median(off)
    print(f"dashboard streaming: {a:.1f} samples/s (median of {args.repeats})")
    print(f"streaming off:       {b:.1f} samples/s (median of {args.repeats})")
    print(f"with/without = {a / b:.3f}")


if __name__ == "__main__":
    main()
