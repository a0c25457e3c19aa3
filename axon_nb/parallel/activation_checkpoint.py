"""Activation checkpointing: recompute a block's activations in backward instead of keeping them."""

from __future__ import annotations

from torch import nn

WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def blocks(model: nn.Module) -> list[tuple[nn.ModuleList | nn.Sequential, int]]:
    """``(container, index)`` of every block: the entries of each ``nn.ModuleList`` (a
    transformer's blocks), or an ``nn.Sequential``'s children when there is no list."""
    lists: list[nn.ModuleList | nn.Sequential]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists and isinstance(model, nn.Sequential):
        lists = [model]
    return [(container, i) for container in lists for i in range(len(container))]


def apply_activation_checkpointing(model: nn.Module, interval: int) -> int:
    """Wrap every ``interval``-th block of each list in PyTorch's ``checkpoint_wrapper``;
    returns how many were wrapped.

    Runs after tensor parallelism and before the pipeline split and data parallelism, so
    stages hold (and FSDP shards) the wrapped blocks. Names keep the wrapper's prefix inside
    the module; :func:`canonical_name` removes it wherever a name leaves the rank.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    found = blocks(model)
    if not found:
        raise ValueError(
            "activation checkpointing wraps the model's blocks (the entries of an "
            "nn.ModuleList, or an nn.Sequential's children), and this model has none"
        )
    wrapped = 0
    for container, i in found:
        if i % interval == 0:
            container[i] = checkpoint_wrapper(container[i])
            wrapped += 1
    return wrapped


def canonical_name(name: str) -> str:
    """A parameter or buffer name as the unwrapped model has it."""
    return name.replace(WRAPPER_PREFIX, "")


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for ``module``'s parameters, names as the unwrapped model has
    them (how optimizer state is keyed in checkpoints)."""
    return {id(p): canonical_name(n) for n, p in module.named_parameters()}
