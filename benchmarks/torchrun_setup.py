"""The first lines of a plain torchrun training script, shared by the benchmarks' scripts."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_torchrun(device_type: str) -> torch.device:
    """Join the process group torchrun describes (NCCL on this rank's GPU, or gloo with the
    CPU threads split between the host's ranks, as axon_nb splits them); this rank's device."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")
