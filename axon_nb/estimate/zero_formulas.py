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

Only trainable parameters have gradients and optimizer state: with ``Φ`` of the ``Ψ`` training
(a LoRA adapter on a frozen base), the gradient and optimizer terms count ``Φ`` in place of ``Ψ``.

Example::

    axon_nb.estimate.memory(1_000_000, axon_nb.ZeRO(stage=1), world_size=4)["total"]
    axon_nb.estimate.memory(peft_model, "fsdp", world_size=4)   # frozen base: Φ from the model
    axon_nb.estimate.memory(7e9, "ddp", world_size=8, trainable=4e6)
"""

from __future__ import annotations

from typing import Any

BYTES = {
    # (params, grads, optimizer) bytes per parameter, unsharded
    True: (2, 2, 12),  # fp16/bf16 params and grads; fp32 master copy + two fp32 moments
    False: (4, 4, 8),  # fp32 params and grads; two fp32 moments
}


def memory(
    model_or_num_params: Any,
    strategy: Any,
    world_size: int,
    *,
    mixed_precision: bool = False,
    trainable: float | None = None,
) -> dict[str, float]:
    """Per-rank bytes of ``params``, ``grads``, ``optimizer`` and their ``total`` for Adam.

    ``strategy`` is a strategy object (``DDP``, ``ZeRO``, ``FSDP``) or its name; shards are
    counted at rest, between steps. ``trainable``: how many of the parameters train (default:
    a model's parameters with ``requires_grad``, all of a count); only they have gradients
    and optimizer state.
    """
    psi = _num_params(model_or_num_params)
    phi = _trainable(model_or_num_params) if trainable is None else trainable
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= phi <= psi:
        raise ValueError(f"trainable must be between 0 and the {psi} parameters, got {phi}")
    param_b, grad_b, optim_b = BYTES[mixed_precision]
    shards = _shards(strategy, world_size)
    figures = {
        "params": psi * param_b / shards["params"],
        "grads": phi * grad_b / shards["grads"],
        "optimizer": phi * optim_b / shards["optimizer"],
    }
    figures["total"] = sum(figures.values())
    return figures


def _num_params(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if hasattr(value, "parameters"):
        return sum(p.numel() for p in value.parameters())
    raise TypeError(f"give a model or a parameter count, got {type(value).__name__}")


def _trainable(value: Any) -> float:
    """A model's parameters with ``requires_grad``; all of a count."""
    if hasattr(value, "parameters"):
        return sum(p.numel() for p in value.parameters() if p.requires_grad)
    return _num_params(value)


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
