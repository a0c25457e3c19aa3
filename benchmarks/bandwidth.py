"""All-reduce bus bandwidth through ``cluster.bandwidth`` against a plain torch.distributed loop.

On 2 ranks, for 1 MiB to 64 MiB: ``cluster.bandwidth("all_reduce", ...)`` and a hand-written
loop of ``dist.all_reduce`` on the same ranks and buffer sizes, back to back at each size.
Each repeat measures both ways back to back, in alternating order (so drift on a busy
machine falls on both alike), and gives one paired ratio; a size's ratio is the median of its
repeats' ratios. Prints both bus bandwidths per size, the median ratio over the sizes and,
last, the lowest ratio over the sizes (cluster.bandwidth / plain loop). Target: >= 0.95 (the
figure is the collective itself).

    python benchmarks/bandwidth.py [--ranks 2] [--iters 20] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics

import axon_nb
from axon_nb.cluster.bandwidth import parse_sizes

SIZES = "1M:64M"


def plain_loop(size: int, iters: int, warmup: int) -> float:
    """(On every rank) seconds per all-reduce of ``size`` bytes, the slowest rank's."""
    import time

    import torch
    import torch.distributed as dist

    from axon_nb.rank import runtime

    device = runtime.context().device
    buf = torch.ones(size // 4, device=device)
    for _ in range(warmup):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    took = took.to(device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sizes = parse_sizes(SIZES)
    factor = 2 * (args.ranks - 1) / args.ranks
    ours: dict[int, list[float]] = {s: [] for s in sizes}
    plain: dict[int, list[float]] = {s: [] for s in sizes}
    with axon_nb.Cluster(n=args.ranks) as cluster:

        def measure_ours(size: int) -> None:
            report = cluster.bandwidth("all_reduce", sizes=[size], iters=args.iters, warmup=3)
            ours[size].append(report.busbw("all_reduce", size))

        def measure_plain(size: int) -> None:
            seconds = cluster.run(plain_loop, size, args.iters, 3, stream=False)[0]
            plain[size].append(size / seconds * factor)

        for repeat in range(args.repeats):
            for size in sizes:  # both ways back to back at each size, the order alternating
                pair = (measure_ours, measure_plain)
                for measure in pair if repeat % 2 == 0 else pair[::-1]:
                    measure(size)
    ratios = []
    for size in sizes:
        ratio = statistics.median(a / b for a, b in zip(ours[size], plain[size], strict=True))
        a, b = statistics.median(ours[size]), statistics.median(plain[size])
        ratios.append(ratio)
        print(f"{size >> 20:>3} MiB: cluster.bandwidth {a / 1e9:.3f} GB/s, "
              f"plain loop {b / 1e9:.3f} GB/s, ratio {ratio:.3f}")  # fmt: skip
    print(f"median ratio over the sizes: {statistics.median(ratios):.3f}")
    print(f"cluster.bandwidth/plain loop (lowest over sizes) = {min(ratios):.3f}")


if __name__ == "__main__":
    main()
