"""Recovery from a killed rank, and what periodic checkpoints cost.

A GPT run on ``--ranks`` (4) ranks with ``checkpoint_every=20`` and ``max_restarts=1`` gets a
SIGKILL of a random rank at a random step: prints the seconds from the kill until training
runs again (the first step after the restart), and the steps computed again. Then the same
run with and without periodic checkpoints, alternating, and last the slowdown of the runs with
checkpoints against those without (ratio of median wall times; target <= 1.05).

    python benchmarks/recovery.py [--ranks 4] [--steps 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from typing import Any

import axon_nb
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset


def kill_a_rank_at(cluster: axon_nb.Cluster, step: int, rank: int) -> dict[str, float]:
    """From a thread: SIGKILL ``rank`` once the next ``train`` call has streamed ``step``.
    Fills the returned dict with ``killed_at`` and (once training runs again) ``resumed_at``
    (``time.monotonic()``), or with ``missed`` when that call ended before ``step`` was seen:
    the kill never lands in a later call."""
    times: dict[str, float] = {}
    first = cluster.last_run

    def watch() -> None:
        deadline = time.monotonic() + 600
        target = killed_run = None
        while time.monotonic() < deadline:
            run = cluster.last_run
            if run is None or run is first:
                time.sleep(0.01)
                continue
            if target is None:
                target = run
            if killed_run is None:
                steps = [m["step"] for m in target.latest.values()]
                if steps and min(steps) >= step:
                    os.kill(cluster.ranks[rank]["pid"], signal.SIGKILL)
                    times["killed_at"], killed_run = time.monotonic(), target
                elif target.done:
                    times["missed"] = time.monotonic()
                    return
            elif run is not killed_run and run.history:
                times["resumed_at"] = time.monotonic()
                return
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    train: dict[str, Any] = dict(
        model=lambda: GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4)),
        data=token_dataset,
        loss=lm_loss,
        steps=args.steps,
        batch_size=32,
        optimizer=("adamw", {"lr": 3e-4}),
        metrics_interval_s=0.1,
    )
    with axon_nb.Cluster(n=args.ranks, timeout=60) as cluster, tempfile.TemporaryDirectory() as tmp:
        kill_step, victim = rng.randint(args.every + 1, args.steps - 5), rng.randrange(args.ranks)
        times = kill_a_rank_at(cluster, kill_step, victim)
        result = cluster.train(
            **train, checkpoint_dir=f"{tmp}/killed", checkpoint_every=args.every, max_restarts=1
        )
        if "missed" in times:
            raise SystemExit(f"the run ended before step {kill_step} was seen: no rank was killed")
        restart = result.restarts[0]
        print(
            f"killed rank {victim} at step {restart['failed_at_step']}: training again after "
            f"{times['resumed_at'] - times['killed_at']:.1f} s, from checkpoint step "
            f"{restart['resumed_from']}; steps computed again: "
            f"{restart['failed_at_step'] - restart['resumed_from']}"
        )
        walls: dict[str, list[float]] = {"with": [], "without": []}
        for i in range(args.repeats):
            for kind in ("without", "with"):
                extra = {}
                if kind == "with":
                    extra = dict(checkpoint_dir=f"{tmp}/{i}", checkpoint_every=args.every, keep=2)
                started = time.perf_counter()
                cluster.train(**train, **extra)
                walls[kind].append(time.perf_counter() - started)
                print(f"run {i + 1} {kind} checkpoints: {walls[kind][-1]:.2f} s", flush=True)
    ratio = statistics.median(walls["with"]) / statistics.median(walls["without"])
    print(f"slowdown with checkpoints every {args.every} steps (with / without): {ratio:.3f}")


if __name__ == "__main__":
    main()
