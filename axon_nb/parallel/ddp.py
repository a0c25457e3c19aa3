"""Replicated data parallelism with ``DistributedDataParallel`` and its comm hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from axon_nb.parallel.async_sgd import StaleGradients, stale_hook, stale_of
from axon_nb.spec.parallel_config import DDPConfig, LocalSGDConfig


def apply_ddp(
    model: nn.Module,
    group: Any,
    device: torch.device,
    config: DDPConfig,
    local_sgd: LocalSGDConfig | None = None,
    ignored: list[str] | None = None,
    *,
    local_steps: bool = False,
    stale: StaleGradients | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``group`` (the data-parallel ranks) with ``config``'s hook,
    or with ``local_sgd``: PyTorch's post-local SGD hook, which all-reduces gradients for the
    warm-up steps and none after (the optimizer then averages parameters, see
    :func:`local_sgd_optimizer`). ``local_steps``: no gradient all-reduce at all (DiLoCo's
    inner steps; its optimizer talks, ``parallel/diloco.py``). ``stale``: AsyncSGD's hook,
    which hands DDP the mean gradients of a few steps ago (``parallel/async_sgd.py``).

    The hook is always a Python one, even for plain fp32: its all-reduce goes through
    ``torch.distributed.all_reduce``, where the metrics probe measures bytes and time.
    """
    if ignored:  # parameters synchronised elsewhere (expert parallelism's experts)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
    if local_sgd is not None or local_steps:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local

        state = local.PostLocalSGDState(
            process_group=group,
            subgroup=None,
            start_localSGD_iter=local_sgd.warmup_steps if local_sgd is not None else 0,
            post_local_gradient_allreduce=False,  # local steps: no gradient all-reduce at all
        )
        ddp.register_comm_hook(state, local.post_localSGD_hook)
        return ddp
    if stale is not None:
        ddp.register_comm_hook(stale, stale_hook)
        stale_of[ddp] = stale  # (for the optimizer: ``AsyncSGDOptimizer``)
        return ddp
    state, hook = _hook(config, group, backend=torch.distributed.get_backend(group))
    ddp.register_comm_hook(state, hook)
    return ddp


def local_sgd_optimizer(
    optimizer: torch.optim.Optimizer, group: Any, config: LocalSGDConfig
) -> torch.optim.Optimizer:
    """``optimizer`` stepping on local gradients, with parameters averaged over ``group``
    every ``period`` steps after the warm-up (PyTorch's ``PostLocalSGDOptimizer``)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    averager = PeriodicModelAverager(
        period=config.period, warmup_steps=config.warmup_steps, process_group=group
    )
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)


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


def _bf16_hook(process_group, bucket):
    """PyTorch's ``bf16_compress_hook`` under another name, for gloo.

    (Unannotated on purpose: DDP compares a hook's annotations with ``dist.GradBucket``.)

    DDP refuses that hook by name unless NCCL >= 2.10 is present (an NCCL requirement);
    gloo all-reduces bfloat16 fine, so on gloo it is registered through this wrapper.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
