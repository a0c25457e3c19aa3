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

    axon_nb.estimate.memory(1_000_000, axon_nb.ZeRO(stage=1), world_size=4)["total"]
"""

from __future__ import annotations

from typing import Any

BYTES = {
    # (params, grads, optimizer) bytes per parameter, unsharded
    True: (2, 2, 12),  # fp16/bf16 params and grads; fp32 master copy + two fp32 moments
    False: (4, 4, 8),  # fp32 params and grads; two fp32 moments
}


def memory(
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
    """Over how many ranks each part of the model state is split, from the strategy's layout."""
    from axon_nb.strategies import SingleDevice, resolve_strategy

    whole = {"params": 1, "grads": 1, "optimizer": 1}
    try:
        strategy = resolve_strategy(strategy)
    except ValueError:
        strategy = None
    if isinstance(strategy, SingleDevice):
        return whole
    dims = strategy.dims(world_size, world_size) if strategy is not None else None
    if dims is None or dims.tp > 1 or dims.pp > 1:
        raise ValueError(f"no memory formula for strategy {strategy!r}: use ddp, zero or fsdp")
    kind, shard = strategy.config().data_parallel, dims.dp_shard
    return {
        "none": whole,
        "ddp": whole,
        "zero1": {"params": 1, "grads": 1, "optimizer": shard},
        "zero2": {"params": 1, "grads": shard, "optimizer": shard},
        "fsdp": {"params": shard, "grads": shard, "optimizer": shard},
    }[kind]
