"""Ctrl-C at random moments of training runs: how many leave the ranks usable.

Fires ``--count`` interrupts (some double) at random moments of ``cluster.train`` runs across
DDP, FSDP, ZeRO-2 and Pipeline on a fresh 2-rank cluster (so the first ones land among the
first imports and model builds), as a user's Ctrl-C does: SIGINT to the kernel's process while
it waits. After each, the ranks must still run a collective and a short training run.
Prints each outcome, and last ``survived/fired`` (target 100/100).

    python benchmarks/interrupt_fuzz.py --count 100
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from typing import Any

import axon_nb
from axon_nb import DDP, FSDP, Pipeline, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

ARGS: dict[str, Any] = dict(
    model=lambda: GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=64)),
    data=token_dataset,
    loss=lm_loss,
    batch_size=16,
    optimizer=("adamw", {"lr": 1e-3}),
)
STRATEGIES = [DDP(), FSDP(), ZeRO(stage=2), Pipeline()]


def _world_sum() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def fire(cluster: axon_nb.Cluster, count: int, *, seed: int = 0, log: bool = True) -> int:
    """Interrupt ``count`` runs at random moments; returns how many left the ranks usable."""
    rng = random.Random(seed)
    survived = 0
    for i in range(count):
        strategy = STRATEGIES[i % len(STRATEGIES)]
        delays = [rng.uniform(0.0, 2.0)]
        if rng.random() < 0.3:  # a second, impatient Ctrl-C
            delays.append(delays[0] + rng.uniform(0.02, 0.5))
        timers = [threading.Timer(d, os.kill, (os.getpid(), signal.SIGINT)) for d in delays]
        started = time.monotonic()
        for timer in timers:
            timer.start()
        outcome = "finished"
        try:
            result = cluster.train(**ARGS, strategy=strategy, steps=200, name="fuzz")
            outcome = result.status
        except KeyboardInterrupt:
            outcome = "interrupted"
        except axon_nb.RankError as e:
            outcome = f"rank error ({e.ename})"
        _join(timers)
        try:
            usable = cluster.run(_world_sum, stream=False) == [float(len(cluster.ranks))] * len(
                cluster.ranks
            )
            check = cluster.train(**ARGS, strategy=strategy, steps=2, name="check")
            usable = usable and check.step == 2
        except (axon_nb.AxonError, KeyboardInterrupt) as e:
            usable = False
            outcome += f"; then {type(e).__name__}: {e}"
        survived += usable
        if log:
            print(
                f"{i + 1:3d} {strategy!r:16} at {delays} s: {outcome}, "
                f"{'usable' if usable else 'NOT USABLE'} ({time.monotonic() - started:.1f} s)",
                flush=True,
            )
    return survived


def _join(timers: list[threading.Timer]) -> None:
    """Wait for every interrupt to have fired (a late one lands here, between cells, as a
    user's impatient second Ctrl-C after the run ended would: harmless)."""
    for timer in timers:
        while True:
            try:
                timer.join()
                break
            except KeyboardInterrupt:
                continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with axon_nb.Cluster(n=args.ranks, timeout=60) as cluster:
        survived = fire(cluster, args.count, seed=args.seed)
    print(f"survived/fired: {survived}/{args.count}")


if __name__ == "__main__":
    main()
