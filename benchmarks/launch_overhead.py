"""Training throughput of ``cluster.train`` against a plain torchrun script, same workload.

Both train ``ddp_workload``'s model with DDP on 2 CPU ranks (gloo) for the same steps, in
alternating runs in one process; the first ``--warmup`` steps are left out of each figure.
Prints samples/s of each run and its pair's ratio (axon_nb / torchrun), the medians of each
side and their ratio, and, last, the median of the pairs' ratios: the figure to judge by, since
each pair ran under the same load of the host. Target: >= 0.98.

    python benchmarks/launch_overhead.py [--steps 120] [--warmup 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(HERE))

import ddp_workload  # noqa: E402

import axon_nb  # noqa: E402


def torchrun_run(ranks: int, steps: int, warmup: int, device: str) -> float:
    script = [str(HERE / "ddp_workload.py"), str(steps), str(warmup), device]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
    out = subprocess.run([*torchrun, *script], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("samples_per_s="))
    return float(line.split("=", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo) even on a GPU host
    axon, plain, ratios = [], [], []
    with axon_nb.Cluster(n=args.ranks) as cluster:
        for i in range(args.repeats):
            axon.append(ddp_workload.train_on_cluster(cluster, args.steps, args.warmup)[0])
            plain.append(torchrun_run(args.ranks, args.steps, args.warmup, args.device))
            ratios.append(axon[-1] / plain[-1])
            print(
                f"run {i + 1}: axon_nb {axon[-1]:.1f} samples/s, torchrun {plain[-1]:.1f}, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
    a, t = statistics.median(axon), statistics.median(plain)
    print(f"axon_nb cluster.train: {a:.1f} samples/s (median of {args.repeats})")
    print(f"torchrun script:       {t:.1f} samples/s (median of {args.repeats})")
    print(f"ratio of medians:      axon_nb/torchrun = {a / t:.3f}")
    pairs = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"pair ratios:           {pairs}")
    print(f"median of paired runs: axon_nb/torchrun = {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
