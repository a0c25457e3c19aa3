"""Per-rank memory: bytes held by model state, process RSS and (on GPU) CUDA allocator figures."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psutil

from axon_nb.metrics.gpu_util import utilization

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.metrics.peak import PeakTracker


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of this rank's storage for ``tensors`` (local shards of DTensors; shared once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if local.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[Any]:
    """Every tensor in the optimizer's per-parameter state (moments, step counters, ...)."""
    import torch

    # ZeroRedundancyOptimizer keeps this rank's shard of the state in its local optimizer.
    local = getattr(optimizer, "optim", optimizer)
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def snapshot(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: Any, peak_bytes: int | None = None
) -> dict[str, int]:
    """Memory figures of this rank, all in bytes.

    Always: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (this rank's local tensors)
    and ``rss_bytes`` (process resident set). ``peak_bytes``: on CUDA the allocator's peak
    since the run started, on CPU the ``peak_bytes`` given (see ``metrics.peak``). On CUDA
    also ``cuda_allocated``, ``cuda_reserved`` and ``cuda_peak``, and where NVML is available
    ``gpu_util`` and ``memory_bw_util`` (percent, ``axon_nb.metrics.gpu_util``).
    """
    figures = {**model_state(model, optimizer), "rss_bytes": psutil.Process().memory_info().rss}
    if peak_bytes is not None:
        figures["peak_bytes"] = peak_bytes
    if getattr(device, "type", None) == "cuda":
        import torch

        figures.update(
            cuda_allocated=torch.cuda.memory_allocated(device),
            cuda_reserved=torch.cuda.memory_reserved(device),
            cuda_peak=torch.cuda.max_memory_allocated(device),
        )
        figures["peak_bytes"] = figures["cuda_peak"]
        figures.update(utilization(device))
    return figures


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds between steps: model state plus the gradient buckets of every
    ``DistributedDataParallel`` in ``model`` (allocated once, when DDP wraps the model)."""
    return sum(held_parts(model, optimizer).values())


def held_parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """:func:`held_bytes` by part: ``params``, ``grads``, ``optimizer state``, ``buckets``,
    and ``strategy``: what a strategy keeps of its own (DiLoCo's global parameters and outer
    momentum, AsyncSGD's gradients in flight: the optimizer's ``kept_tensors()``)."""
    state = model_state(model, optimizer)
    kept = getattr(optimizer, "kept_tensors", None)
    return {
        "params": state["param_bytes"],
        "grads": state["grad_bytes"],
        "optimizer state": state["optimizer_bytes"],
        "buckets": ddp_bucket_bytes(model),
        "strategy": sum(t.numel() * t.element_size() for t in kept()) if kept else 0,
    }


def peak_parts(
    tracker: PeakTracker, held: dict[str, int], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """What a tracked step's peak was made of: ``peak_phase`` (``forward``, ``backward``,
    ``step`` or ``pipeline``) and ``peak_parts``, bytes by part: the ``held`` parts at the
    step's start plus what the tracker saw alive at its peak (gradients and optimizer state
    made in the step are known by the tensors they are now). Call it before ``zero_grad``."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    for p in [*model.parameters(), *stepped]:
        tracker.label(p.grad, "grads")
    for tensor in optimizer_tensors(optimizer):
        tracker.label(tensor, "optimizer state")
    parts = dict(held)
    for kind, nbytes in tracker.breakdown().items():
        parts[kind] = parts.get(kind, 0) + nbytes
    return {"peak_phase": tracker.peak_phase, "peak_parts": {k: v for k, v in parts.items() if v}}


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of the gradient buckets DDP's reducers hold (its logging data lists them)."""
    from torch.nn.parallel import DistributedDataParallel

    total = 0
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            sizes = str(module._get_ddp_logging_data().get("bucket_sizes", ""))
            total += sum(int(size) for size in re.findall(r"\d+", sizes))
    return total


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's ``param_bytes``, ``grad_bytes`` and ``optimizer_bytes``."""
    params = list(model.parameters())
    # A sharding optimizer may step its own views of the parameters (ZeRO-2's bucket
    # slices), whose gradients are the only ones left between backward and step.
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes(p.grad for p in [*params, *stepped]),
        "optimizer_bytes": tensor_bytes(optimizer_tensors(optimizer)),
    }
