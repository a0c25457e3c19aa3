"""Training speed on one GPU: ``cluster.train`` against a plain torchrun script, and MFU.

Both train ``gpt_workload``'s GPT-2-small-sized GPT (bf16 autocast, compiled blocks, fused
AdamW) for the same steps, alternating, the first ``--warmup`` steps left out. Prints
tokens/s of each, their MFU (model FLOPs per token x tokens/s / the GPU's peak bf16 FLOP/s,
looked up from the device name or given with ``--peak-tflops``) and, last, the ratio of
medians axon_nb/script. Targets: ratio >= 0.98, MFU >= 40% on an H100.

    python benchmarks/gpu_throughput.py --device cuda [--steps 60] [--warmup 15] [--repeats 3]
    python benchmarks/gpu_throughput.py --device cpu --size tiny   # a check of the script
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

import gpt_workload  # noqa: E402

import axon_nb  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0}
"""Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's data sheets, SXM parts."""


def torchrun_run(size: str, steps: int, warmup: int, device: str) -> float:
    script = [str(HERE / "gpt_workload.py"), size, str(steps), str(warmup), device]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    out = subprocess.run([*torchrun, *script], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("tokens_per_s="))
    return float(line.split("=", 1)[1])


def peak_flops(device: str, given: float | None) -> float | None:
    """The device's peak bf16 FLOP/s: ``given`` (TFLOP/s), else looked up by name."""
    if given is not None:
        return given * 1e12
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(0)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    sys.exit(f"no known bf16 peak for {name!r}: pass --peak-tflops (from its data sheet)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--size", choices=sorted(gpt_workload.SIZES), default="gpt2-small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    peak = peak_flops(args.device, args.peak_tflops)
    per_token = gpt_workload.flops_per_token(args.size)
    axon, plain = [], []
    with axon_nb.Cluster(n=1, timeout=600) as cluster:
        for i in range(args.repeats):
            axon.append(gpt_workload.train_on_cluster(cluster, args.size, args.steps, args.warmup))
            plain.append(torchrun_run(args.size, args.steps, args.warmup, args.device))
            print(f"run {i + 1}: axon_nb {axon[-1]:,.0f} tokens/s, script {plain[-1]:,.0f}")
    a, t = statistics.median(axon), statistics.median(plain)
    for label, figure in (("axon_nb cluster.train", a), ("torchrun script", t)):
        mfu = f", MFU {100 * per_token * figure / peak:.1f}%" if peak else ""
        print(f"{label}: {figure:,.0f} tokens/s (median of {args.repeats}){mfu}")
    print(f"axon_nb/script = {a / t:.3f}")


if __name__ == "__main__":
    main()
