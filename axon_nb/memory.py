"""Expected per-rank model-state memory, from the ZeRO paper's formulas (Rajbhandari et al., 2020).

Model state is parameters, gradients and optimizer state (Adam: two moments, plus an fp32
master copy of the parameters under mixed precision). With Ψ parameters on N ranks:

=================  ====================  ====================
strategy           mixed precision Adam  fp32 Adam
=================  ====================  ====================
DDP (baseline)     16Ψ                   16Ψ
ZeRO-1             4Ψ + 12Ψ/N            8Ψ + 8Ψ/N
ZeRO-2             2Ψ + 14Ψ/N            4Ψ + 12Ψ/N
ZeRO-3 / FSDP      16Ψ/N                 16Ψ/N
=================  ====================  ====================

Example::

    axon_nb.memory.estimate(1_000_000, axon_nb.ZeRO(stage=1), world_size=4)["total"]
"""

from __future__ import annotations

from typing import Any

BYTES = {
    # (params, grads, optimizer) bytes per parameter, unsharded
    True: (2, 2, 12),  # fp16/bf16 params and grads; fp32 master copy + two fp32 moments
    False: (4, 4, 8),  # fp32 params and grads; two fp32 moments
}


def estimate(
    model_or_num_params: Any, strategy: Any, world_size: int, *, mixed_precision: bool = False
) -> dict[str, float]:
    """Per-rank bytes of ``params``, ``grads``, ``optimizer`` and their ``total`` for Adam.

    ``strategy`` is a strategy object (``DDP``, ``ZeRO``, ``FSDP``) or its name; shards are
    counted at rest, between steps.
    """
    psi = _num_params(model_or_num_params)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    param_b, grad_b, optim_b = BYTES[mixed_precision]
    shards = _shards(strategy, world_size)
    figures = {
        "params": psi * param_b / shards["params"],
        "grads": psi * grad_b / shards["grads"],
        "optimizer": psi * optim_b / shards["optimizer"],
    }
    figures["total"] = sum(figures.values())
    return figures


def _num_params(value: Any) -> int:
    if isinstance(value, int):
        return value
    if hasattr(value, "parameters"):
        return sum(p.numel() for p in value.parameters())
    raise TypeError(f"give a model or a parameter count, got {type(value).__name__}")


def _shards(strategy: Any, world_size: int) -> dict[str, int]:
    """Over how many ranks each part of the model state is split."""
    name = strategy if isinstance(strategy, str) else getattr(strategy, "name", "")
    whole = {"params": 1, "grads": 1, "optimizer": 1}
    if name in ("ddp", "single_device"):
        return whole
    if name == "zero":
        stage = getattr(strategy, "stage", 1)
        return {
            "params": world_size if stage >= 3 else 1,
            "grads": world_size if stage >= 2 else 1,
            "optimizer": world_size,
        }
    if name == "fsdp":
        sharding = getattr(strategy, "sharding", "full_shard")
        if sharding == "no_shard":
            return whole
        size = world_size
        if sharding == "hybrid_shard":
            size = getattr(strategy, "shard_size", None) or world_size
        return {"params": size, "grads": size, "optimizer": size}
    raise ValueError(f"no memory formula for strategy {strategy!r}: use ddp, zero or fsdp")
