"""The workload both sides of ``launch_overhead.py`` train: same model, data, optimizer, batch.

Also a plain torchrun script: ``torchrun --nproc_per_node=2 benchmarks/ddp_workload.py STEPS
WARMUP [cpu|cuda]`` trains it with hand-written PyTorch DDP and prints ``samples_per_s=<float>``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchrun_setup import init_torchrun

BATCH_SIZE = 64
"""Global samples per step (32 per rank on 2 ranks)."""
LR = 1e-3
WIDTH = 1024


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 256)
    )


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16384, 256, generator=g)
    return TensorDataset(x, torch.sin(x))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def train_on_cluster(cluster: Any, steps: int, warmup: int, **options: Any) -> tuple[float, Any]:
    """Train the workload with ``cluster.train`` (DDP); samples/s after ``warmup`` steps.

    Steps of all ranks end together (they agree on the loss each step), so rank 0's step
    clock is the run's. Returns the figure and the ``TrainResult``.
    """
    result = cluster.train(
        model=make_model,
        data=make_data,
        loss=loss_fn,
        strategy="ddp",
        optimizer=("adamw", {"lr": LR}),
        steps=steps,
        batch_size=BATCH_SIZE,
        seed=0,
        **options,
    )
    measured = result.history[warmup:]
    seconds = sum(h["per_rank"]["step_time_s"][0] for h in measured)
    return sum(h["samples"] for h in measured) / seconds, result


def torchrun_main(steps: int, warmup: int, device_type: str) -> None:
    """A plain DDP training script, as a user would write it for torchrun."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = init_torchrun(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(make_model().to(device), device_ids=[device] if device_type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH_SIZE // world, sampler=sampler, drop_last=True)
    step, epoch, started = 0, 0, time.perf_counter()
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == warmup:
                started = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    loss.item()
    elapsed = time.perf_counter() - started
    if rank == 0:
        print(f"samples_per_s={BATCH_SIZE * (steps - warmup) / elapsed}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cpu")
