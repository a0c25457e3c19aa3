"""The workload both sides of ``gpu_throughput.py`` train: the reference GPT at a GPT-2-small
size, bf16 autocast, compiled blocks, fused AdamW, next-token data from pinned memory.

Also a plain torchrun script: ``torchrun --nproc_per_node=1 benchmarks/gpt_workload.py SIZE
STEPS WARMUP DEVICE`` trains it with hand-written PyTorch (DDP, the same compile, autocast and
optimizer) and prints ``tokens_per_s=<float>``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchrun_setup import init_torchrun

from axon_nb.models import GPT, GPTConfig, token_dataset

SIZES = {
    # GPT-2 small: 12 layers, 12 heads, width 768, 1024 positions (vocab padded to 64s).
    "gpt2-small": dict(config=GPTConfig(vocab_size=50304, block_size=1024, n_layer=12,
                                        n_head=12, n_embd=768), batch_size=16),
    # For a check of the script on a CPU: the same code at a size a laptop trains in seconds.
    "tiny": dict(config=GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2,
                                  n_embd=64), batch_size=8),
}  # fmt: skip
LR = 3e-4


def make_model(size: str) -> GPT:
    return GPT(SIZES[size]["config"])


def make_data(size: str, steps: int) -> TensorDataset:
    config, batch = SIZES[size]["config"], SIZES[size]["batch_size"]
    return token_dataset(
        batch * (steps + 1), block_size=config.block_size, vocab_size=config.vocab_size
    )


def flops_per_token(size: str) -> float:
    """Training FLOPs per token: 6 per weight (forward and backward matmuls, position
    embeddings left out) plus attention's 12 * layers * width * sequence (PaLM, appendix B)."""
    config = SIZES[size]["config"]
    model = make_model(size)
    weights = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    return 6 * weights + 12 * config.n_layer * config.n_embd * config.block_size


def train_on_cluster(cluster: Any, size: str, steps: int, warmup: int) -> float:
    """Tokens/s of ``cluster.train`` after ``warmup`` steps (rank 0's step clock)."""
    result = cluster.train(
        model=lambda: make_model(size),
        data=lambda: make_data(size, steps),
        optimizer=("adamw", {"lr": LR}),
        steps=steps,
        batch_size=SIZES[size]["batch_size"],
        mixed_precision="bf16",
        compile=True,
        metrics_interval_s=1.0,
    )
    measured = result.history[warmup:]
    seconds = sum(h["per_rank"]["step_time_s"][0] for h in measured)
    tokens = sum(h["samples"] for h in measured) * SIZES[size]["config"].block_size
    return tokens / seconds


def torchrun_main(size: str, steps: int, warmup: int, device_type: str) -> None:
    """The same training as a user would write it for torchrun."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = init_torchrun(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(size).to(device)
    for block in model.blocks:
        block.compile()
    model = DDP(model, device_ids=[device] if device_type == "cuda" else None)
    fused = {"fused": True} if device_type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **fused)
    data = make_data(size, steps)
    batch = SIZES[size]["batch_size"] // world
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(
        data, batch_size=batch, sampler=sampler, drop_last=True, pin_memory=device_type == "cuda"
    )
    started = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            started = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == steps:
            break
    loss.item()  # wait for the last step
    elapsed = time.perf_counter() - started
    if rank == 0:
        tokens = batch * world * (steps - warmup) * SIZES[size]["config"].block_size
        print(f"tokens_per_s={tokens / elapsed}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
