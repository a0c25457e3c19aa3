"""What evaluation during training costs: one evaluation batch against the training forward
pass on the same batch, on the ranks of a real cluster.

A GPT trains one step under ``--strategy`` on ``--ranks`` ranks; then each rank times, on the
laid-out model the run holds, (1) the training forward (train mode, autograd recording, the
loss) on a batch of ``--batch`` samples, and (2) the evaluation of a set of ``--batches``
such batches per data-parallel rank through the same code ``eval_data=`` runs
(``evaluation.evaluate_model``: indexing, collation, no-grad forward, loss, a metric, the
final all-reduce), per batch. Medians over ``--repeats``; the slowest rank's ratio is
printed last (target <= 1.1: evaluating costs no more than the forwards it runs).

    python benchmarks/eval_cost.py [--ranks 2] [--strategy ddp] [--batch 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64)


def _measure(batch: int, batches: int, repeats: int) -> dict[str, float]:
    import torch

    from axon_nb.rank import runtime
    from axon_nb.rank.training import trainstate
    from axon_nb.rank.training.evaluation import evaluate_model

    ctx = runtime.context()
    parallel = trainstate.get("model").parallel
    dp = parallel.dims.dp
    data = token_dataset(batch * batches * dp, block_size=CONFIG.block_size, vocab_size=256)
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]

    def metric(output: Any, target: Any) -> Any:
        return (output.argmax(-1) == target).float().mean()

    forward, evaluation = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        loss = lm_loss(parallel.model(x), y)
        forward.append(time.perf_counter() - started)
        del loss  # the graph is dropped, not run backward
        started = time.perf_counter()
        evaluate_model(
            parallel, data, loss=lm_loss, metrics={"acc": metric}, batch_size=batch, ctx=ctx
        )
        evaluation.append((time.perf_counter() - started) / batches)
    torch.distributed.barrier()
    return {"forward_s": statistics.median(forward), "eval_s": statistics.median(evaluation)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    strategy = DDP() if args.strategy == "ddp" else FSDP()
    with axon_nb.Cluster(n=args.ranks, timeout=120) as cluster:
        cluster.train(
            lambda: GPT(CONFIG),
            lambda: token_dataset(256, block_size=CONFIG.block_size, vocab_size=256),
            loss=lm_loss, strategy=strategy, steps=1, batch_size=args.batch * args.ranks,
        )  # fmt: skip
        figures = cluster.run(_measure, args.batch, args.batches, args.repeats, stream=False)
    ratios = []
    for rank, f in enumerate(figures):
        ratio = f["eval_s"] / f["forward_s"]
        ratios.append(ratio)
        print(
            f"rank {rank}: training forward {f['forward_s'] * 1e3:.1f} ms, evaluation "
            f"{f['eval_s'] * 1e3:.1f} ms per batch of {args.batch}"
        )
    print(f"eval batch / training forward (slowest rank): {max(ratios):.2f}")


if __name__ == "__main__":
    main()
