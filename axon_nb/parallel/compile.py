"""``torch.compile`` on the model's blocks, in place, before the model is sharded.

Each entry of the model's outermost ``nn.ModuleList`` (a transformer's blocks) is compiled on
its own; a model without one is compiled whole. As torchtitan does, this runs after tensor
parallelism and activation checkpointing and before the pipeline split and data parallelism,
so FSDP shards compiled blocks and DDP's hooks stay outside the compiled graphs. Modules are
compiled with ``nn.Module.compile`` (in place), so parameter names, and with them checkpoints
and optimizer state, are the same as without compiling.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> list[str]:
    """Compile ``model``'s blocks (or ``model``) in place; the names of what was compiled.

    Example::

        apply_compile(GPT(GPTConfig(n_layer=2)))  # ["blocks.0", "blocks.1"]
    """
    compiled: list[str] = []
    lists: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        if any(name.startswith(f"{outer}.") for outer in lists):
            continue  # a list inside a block: the block is compiled whole
        lists.append(name)
        for i, block in enumerate(module):
            block.compile()
            compiled.append(f"{name}.{i}" if name else str(i))
    if not compiled:
        model.compile()
        compiled.append("")
    return compiled
