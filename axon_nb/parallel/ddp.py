"""Replicated data parallelism with ``DistributedDataParallel`` and its comm hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from axon_nb.parallel.config import DDPConfig


def apply_ddp(
    model: nn.Module, group: Any, device: torch.device, config: DDPConfig
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``group`` (the data-parallel ranks) with ``config``'s hook.

    The hook is always a Python one, even for plain fp32: its all-reduce goes through
    ``torch.distributed.all_reduce``, where the metrics probe measures bytes and time.
    """
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
    )
    state, hook = _hook(config, group, backend=torch.distributed.get_backend(group))
    ddp.register_comm_hook(state, hook)
    return ddp


def _hook(config: DDPConfig, group: Any, backend: str) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start_step,
        )
        return state, powerSGD_hook.powerSGD_hook
    hooks = {
        None: default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook if backend == "nccl" else _bf16_hook,
    }
    return group, hooks[config.comm_hook]


def _bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """PyTorch's ``bf16_compress_hook`` under another name, for gloo.

    (Unannotated on purpose: DDP compares a hook's annotations with ``dist.GradBucket``.)

    DDP refuses that hook by name unless NCCL >= 2.10 is present (an NCCL requirement);
    gloo all-reduces bfloat16 fine, so on gloo it is registered through this wrapper.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
