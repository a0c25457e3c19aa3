"""AsyncSGD against DDP with transient stragglers: samples/s and the loss after the same samples.

Four CPU ranks train the reference GPT (a small configuration) for the same steps and batch,
first DDP, then ``AsyncSGD(staleness=4)``, in one cluster. At every step one rank, drawn with a
seeded generator (the same draw for both runs), sleeps twice the step time measured first in a
DDP run without stragglers. DDP waits for that rank every step; AsyncSGD's ranks have steps in
hand. Prints each run's samples/s (rank 0's steps after ``--warmup``) and final loss (the mean
of the last 10 steps), then the two ratios: samples/s AsyncSGD / DDP (issue 50's target: at
least 1.6) and the loss gap relative to DDP's (target: within 10%).

    python benchmarks/async_straggler.py [--steps 300] [--warmup 20] [--staleness 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import axon_nb  # noqa: E402
from axon_nb.models import GPT, GPTConfig, token_dataset  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
BATCH = 32
SEED = 1234


class Straggling(nn.Module):
    """``model``, whose training forward on the rank drawn for the step sleeps ``sleep_s``."""

    def __init__(self, model: nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.model, self.sleep_s, self.steps = model, sleep_s, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and self.sleep_s > 0:
            import torch.distributed as dist

            self.steps += 1
            drawn = random.Random(SEED * 100_003 + self.steps).randrange(dist.get_world_size())
            if drawn == dist.get_rank():
                time.sleep(self.sleep_s)
        return self.model(*args, **kwargs)


def make_model(sleep_s: float) -> nn.Module:
    torch.manual_seed(0)
    return Straggling(GPT(CONFIG), sleep_s)


def train(cluster: Any, strategy: Any, steps: int, sleep_s: float) -> axon_nb.TrainResult:
    return cluster.train(
        model=lambda: make_model(sleep_s),
        data=lambda: token_dataset(
            BATCH * (steps + 1), block_size=CONFIG.block_size, vocab_size=CONFIG.vocab_size
        ),
        optimizer=("adamw", {"lr": 1e-3}),
        strategy=strategy,
        steps=steps,
        batch_size=BATCH,
        metrics_interval_s=1.0,
    )


def samples_per_s(result: axon_nb.TrainResult, warmup: int) -> float:
    measured = result.history[warmup:]
    seconds = sum(h["per_rank"]["step_time_s"][0] for h in measured)
    return sum(h["samples"] for h in measured) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--staleness", type=int, default=4)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo)
    with axon_nb.Cluster(n=args.ranks, oversubscribe=True) as cluster:
        calibration = train(cluster, "ddp", args.warmup + 20, 0.0)
        step_s = statistics.median(
            h["per_rank"]["step_time_s"][0] for h in calibration.history[args.warmup :]
        )
        print(f"step time without stragglers: {step_s * 1e3:.1f} ms; straggler sleeps "
              f"{2 * step_s * 1e3:.1f} ms", flush=True)  # fmt: skip
        runs = {}
        for name, strategy in (
            ("DDP", "ddp"),
            ("AsyncSGD", axon_nb.AsyncSGD(staleness=args.staleness)),
        ):
            result = train(cluster, strategy, args.steps, 2 * step_s)
            rate, loss = samples_per_s(result, args.warmup), statistics.mean(result.losses[-10:])
            runs[name] = (rate, loss)
            print(f"{name}: {rate:.1f} samples/s, final loss {loss:.4f}", flush=True)
    (ddp_rate, ddp_loss), (async_rate, async_loss) = runs["DDP"], runs["AsyncSGD"]
    print(f"samples/s AsyncSGD(staleness={args.staleness}) / DDP: {async_rate / ddp_rate:.2f} "
          f"(target >= 1.6)")  # fmt: skip
    print(f"loss gap after {args.steps * BATCH} samples: "
          f"{abs(async_loss - ddp_loss) / ddp_loss:.1%} of DDP's (target <= 10%)")  # fmt: skip


if __name__ == "__main__":
    main()
