"""Measured per-rank model-state bytes next to the ZeRO paper's formulas, on 4 ranks.

Trains a GPT of a few million parameters for a few steps with DDP, ZeRO-1/2/3 and each FSDP
mode (fp32 AdamW), reads each rank's parameter, gradient and optimizer-state bytes from the
run's result, and prints them beside ``axon_nb.estimate.memory``. The last line is the worst
measured/expected ratio over ranks and strategies (target: within 0.95-1.05).

    python benchmarks/memory.py [--ranks 4] [--layers 4] [--width 256]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU host

import axon_nb
from axon_nb import DDP, FSDP, ZeRO, estimate
from axon_nb.models import GPT, GPTConfig, token_dataset

STRATEGIES = [
    DDP(),
    ZeRO(stage=1),
    ZeRO(stage=2),
    ZeRO(stage=3),
    FSDP(sharding="full_shard"),
    FSDP(sharding="shard_grad_op"),
    FSDP(sharding="no_shard"),
    FSDP(sharding="hybrid_shard", shard_size=2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=256)
    num_params = sum(p.numel() for p in GPT(config).parameters())
    print(f"GPT with {num_params / 1e6:.2f} M parameters on {args.ranks} ranks, fp32 AdamW")
    print(f"{'strategy':32} {'expected MiB':>12} {'measured MiB (per rank)':>36} {'ratio':>6}")
    worst = 1.0
    with axon_nb.Cluster(n=args.ranks) as cluster:
        for strategy in STRATEGIES:
            result = cluster.train(
                model=lambda: GPT(config),
                data=lambda: token_dataset(256, vocab_size=256),
                strategy=strategy,
                steps=2,
                batch_size=4 * args.ranks,
                metrics_interval_s=0,
            )
            expected = estimate.memory(num_params, strategy, args.ranks)["total"]
            measured = [
                sum(r["memory"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
                for r in result.ranks
            ]
            ratio = max((m / expected for m in measured), key=lambda r: abs(r - 1))
            worst = max(ratio, worst, key=lambda r: abs(r - 1))
            label = f"{strategy.name} {_detail(strategy)}"
            cells = " ".join(f"{m / 2**20:8.2f}" for m in measured)
            print(f"{label:32} {expected / 2**20:12.2f} {cells:>36} {ratio:6.3f}")
    print(f"worst measured/expected = {worst:.3f}")


def _detail(strategy: object) -> str:
    if isinstance(strategy, ZeRO):
        return f"stage {strategy.stage}"
    if isinstance(strategy, FSDP):
        return strategy.sharding + (f" ({strategy.shard_size})" if strategy.shard_size else "")
    return ""


if __name__ == "__main__":
    main()
