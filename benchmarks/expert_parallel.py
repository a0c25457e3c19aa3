"""Expert parallelism against FSDP on the same MoE GPT: step time, all-to-all bytes, memory.

For each N in ``--ranks`` (2, then 4), one cluster of N ranks trains the reference GPT with
8 experts per block (top-2 routing) for ``--steps`` steps under ``ExpertParallel(ep=N)``
(experts split over the ranks, tokens sent to them by all-to-all; the other parameters
replicated, or sharded with ``--data-parallel fsdp``) and under ``FSDP()`` (everything
sharded, no all-to-all), one after the other on the same ranks. Printed per N, each a ratio
measured in that run:

- step time EP / FSDP: medians of the step times (slowest rank) after the first 2 steps;
- all-to-all bytes per step, summed over the ranks, over the formula: per MoE layer and step
  ``ep * 8 * E`` (each rank's int64 count per expert) ``+ 4 * tokens * top_k * n_embd * 4``
  (every routed fp32 hidden vector there and back, forward and backward); 1.000 is exact;
- per-rank parameter bytes EP / FSDP (``result.memory``, the largest rank of each), beside
  the ratio expected from the parameter counts (experts / ep, the rest whole or / N, against
  everything / N).

More ranks than cores (or GPUs) need ``AXON_NB_OVERSUBSCRIBE=1``, as for every cluster.

    python benchmarks/expert_parallel.py [--ranks 2,4] [--steps 20] [--batch 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import axon_nb
from axon_nb import FSDP, ExpertParallel
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

CONFIG = GPTConfig(
    n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32, experts=8, top_k=2
)
SKIP = 2
"""Steps left out of the step-time medians (the first creates the optimizer state)."""


def all_to_all_formula(ep: int, batch: int) -> int:
    """All-to-all bytes per step, summed over the ranks, for ``batch`` samples a step."""
    tokens = batch * CONFIG.block_size
    per_layer = ep * 8 * CONFIG.experts + 4 * tokens * CONFIG.top_k * CONFIG.n_embd * 4
    return CONFIG.n_layer * per_layer


def expected_param_ratio(ranks: int, data_parallel: str) -> float:
    """Per-rank parameter bytes EP / FSDP from the parameter counts (FSDP's padding aside)."""
    model = GPT(CONFIG)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = total - experts
    ep = experts / ranks + (rest if data_parallel == "ddp" else rest / ranks)
    return ep / (total / ranks)


def step_time(result: Any) -> float:
    return statistics.median(h["step_time_s"] for h in result.history[SKIP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="samples per step, all ranks")
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo) even on a GPU host
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP}")
    train = dict(
        model=lambda: GPT(CONFIG),
        data=lambda n=args.batch * args.steps: token_dataset(
            n, block_size=CONFIG.block_size, vocab_size=CONFIG.vocab_size
        ),
        loss=lm_loss,
        steps=args.steps,
        batch_size=args.batch,
        seed=0,
    )
    print(
        f"MoE GPT: {CONFIG.n_layer} layers, width {CONFIG.n_embd}, {CONFIG.experts} experts, "
        f"top-{CONFIG.top_k}; {args.batch} x {CONFIG.block_size} tokens a step, "
        f"{args.steps} steps, {args.device}"
    )
    for ranks in (int(n) for n in args.ranks.split(",")):
        strategy = ExpertParallel(ep=ranks, data_parallel=args.data_parallel)
        with axon_nb.Cluster(n=ranks, timeout=300) as cluster:
            ep = cluster.train(**train, strategy=strategy)
            fsdp = cluster.train(**train, strategy=FSDP())
        sent = sum(r["comm_totals"]["all_to_all"]["bytes"] for r in ep.ranks) / ep.steps
        formula = all_to_all_formula(ranks, args.batch)
        ep_params = max(m["param_bytes"] for m in ep.memory)
        fsdp_params = max(m["param_bytes"] for m in fsdp.memory)
        ep_s, fsdp_s = step_time(ep), step_time(fsdp)
        print(f"{ranks} ranks, ExpertParallel(ep={ranks}, data_parallel={args.data_parallel!r}):")
        print(
            f"  step time EP / FSDP = {ep_s / fsdp_s:.3f} "
            f"({ep_s * 1e3:.1f} ms / {fsdp_s * 1e3:.1f} ms, median after {SKIP} steps)"
        )
        print(
            f"  all-to-all bytes per step / formula = {sent / formula:.3f} "
            f"({sent:,.0f} / {formula:,})"
        )
        print(
            f"  param bytes per rank EP / FSDP = {ep_params / fsdp_params:.3f} "
            f"({ep_params:,} / {fsdp_params:,}; expected "
            f"{expected_param_ratio(ranks, args.data_parallel):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
