"""Measured pipeline bubble per schedule, next to the formula, for p = 2 and 4 stages.

Trains the reference GPT with ``Pipeline`` on p ranks for a few steps per configuration and
reads the measured bubble: the share of each stage's step time spent neither in forward nor
in backward (``result.bubble``, first step left out). The formula is (p-1)/(m+p-1) for GPipe
and 1F1B with m micro-batches, and (p-1)/(v*m+p-1) for interleaved 1F1B with v stages per
rank. The last line is the worst measured/formula ratio (1.0 is the ideal; communication and
Python overhead push it up, and ranks sharing CPU cores distort it).

Each micro-batch holds ``--micro-size`` samples whatever m is, so the work per micro-batch (and
the fixed cost of sending it) stays the same as m grows.

    python benchmarks/pipeline_bubble.py [--stages 2 4] [--microbatches 4 8 16] [--steps 4]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU host

import axon_nb
from axon_nb import Pipeline
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset


def formula(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-size", type=int, default=8)
    args = parser.parse_args()

    worst = 1.0  # the ratio farthest from 1
    print(f"{'p':>2} {'schedule':>18} {'m':>3} {'measured':>9} {'formula':>8} {'ratio':>6}")
    for p in args.stages:
        config = GPTConfig(n_layer=2 * p, n_embd=args.width, n_head=4)  # 2p+2 layers
        train = dict(
            model=lambda config=config: GPT(config),
            data=token_dataset,
            loss=lm_loss,
            steps=args.steps,
        )
        with axon_nb.Cluster(n=p, timeout=120) as cluster:
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
                for m in args.microbatches:
                    strategy = Pipeline(schedule=schedule, microbatches=m, virtual_stages=v)
                    batch = m * args.micro_size
                    result = cluster.train(**train, batch_size=batch, strategy=strategy)
                    expected = formula(p, m, v)
                    ratio = result.bubble / expected
                    worst = max(worst, ratio, key=lambda r: abs(r - 1))
                    print(
                        f"{p:2d} {schedule:>18} {m:3d} {result.bubble:9.3f} {expected:8.3f} "
                        f"{ratio:6.2f}",
                        flush=True,
                    )
    print(f"worst measured/formula = {worst:.2f}")


if __name__ == "__main__":
    main()
