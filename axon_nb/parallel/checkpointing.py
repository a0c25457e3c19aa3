"""Activation checkpointing: recompute a block's activations in backward instead of keeping them."""

from __future__ import annotations

from torch import nn


def apply_activation_checkpointing(model: nn.Module, interval: int) -> int:
    """Wrap every ``interval``-th entry of each ``nn.ModuleList`` (a transformer's blocks) in
    PyTorch's ``checkpoint_wrapper``; returns how many were wrapped.

    Runs before sharding, so FSDP shards the wrapped blocks. State-dict names are unchanged
    through ``torch.distributed.checkpoint.state_dict``, which strips the wrapper's prefix.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if interval < 1:
        raise ValueError(f"activation checkpoint interval must be >= 1, got {interval}")
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    wrapped = 0
    for blocks in lists:
        for i in range(0, len(blocks), interval):
            blocks[i] = checkpoint_wrapper(blocks[i])
            wrapped += 1
    if not wrapped:
        raise ValueError(
            "activation checkpointing wraps the entries of the model's nn.ModuleList "
            "(its blocks), and this model has none"
        )
    return wrapped
