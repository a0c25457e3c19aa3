"""Tensor parallelism on ``torch.distributed.tensor.parallel``: plans and how they are applied.

A plan maps module names (``fnmatch`` patterns such as ``"blocks.*.attn.q"``) to a style:

- ``"colwise"``: an ``nn.Linear`` whose output features are split over the tensor-parallel
  ranks (its input is whole; its output is this rank's slice);
- ``"rowwise"``: an ``nn.Linear`` whose input features are split (it takes the slice a
  column-parallel layer produced) and whose partial outputs are summed over the ranks.

A column-parallel layer followed by a row-parallel one (attention's q/k/v then out, an MLP's
up then down) needs one all-reduce in forward and one in backward.

With ``sequence_parallel`` the norms between them also split their work, along the sequence
dimension: the residual stream between blocks stays sharded by sequence, each block gathers
it before attention and the MLP, and their row-parallel outputs are reduce-scattered back to
sequence shards. That needs the transformer blocks in ``model.blocks``.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from axon_nb.spec.parallel_config import TP_STYLES as STYLES
from axon_nb.spec.parallel_config import TensorConfig


class ColumnParallelLinear(nn.Linear):
    """An ``nn.Linear`` whose output features ``TensorParallel`` splits over its ranks.

    In one process (or any other strategy) it is a plain ``nn.Linear``. Example::

        self.up = ColumnParallelLinear(256, 1024)    # each of 4 ranks computes 256 outputs
        self.down = RowParallelLinear(1024, 256)     # and sums its partial 256-wide result
    """


class RowParallelLinear(nn.Linear):
    """An ``nn.Linear`` whose input features ``TensorParallel`` splits over its ranks (see
    :class:`ColumnParallelLinear`)."""


def default_plan(model: nn.Module) -> dict[str, str]:
    """The plan ``TensorParallel`` uses without one: the model's Column/RowParallelLinear
    layers, else the reference GPT's (attention q/k/v column, out row; MLP up column, down row)."""
    plan = {
        name: "colwise" if isinstance(m, ColumnParallelLinear) else "rowwise"
        for name, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    }
    if plan:
        return plan
    if _is_gpt(model):
        return {
            "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise",
            "blocks.*.attn.out": "rowwise",
            "blocks.*.mlp.up": "colwise",
            "blocks.*.mlp.down": "rowwise",
        }
    raise ValueError(
        f"no tensor-parallel plan for {type(model).__name__}: pass TensorParallel(plan={{module "
        "name pattern: 'colwise' | 'rowwise'}}), or build the model with ColumnParallelLinear / "
        "RowParallelLinear layers"
    )


def resolve_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """Exact module names for ``plan``'s patterns, checked: every pattern matches an
    ``nn.Linear``, styles are known, and the split features divide by ``tp``."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    problems = []
    for pattern, style in plan.items():
        if style not in STYLES:
            problems.append(f"{pattern!r}: style must be 'colwise' or 'rowwise', got {style!r}")
            continue
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            problems.append(f"{pattern!r} matches no module of the model")
        for name in names:
            module = modules[name]
            if not isinstance(module, nn.Linear):
                problems.append(f"{name} is a {type(module).__name__}, not an nn.Linear")
                continue
            features = module.out_features if style == "colwise" else module.in_features
            if features % tp:
                kind = "output" if style == "colwise" else "input"
                problems.append(f"{name} has {features} {kind} features, not divisible by tp={tp}")
            resolved[name] = style
    if _is_gpt(model):
        config = model.config  # type: ignore[attr-defined]
        if config.n_head % tp:
            problems.append(f"n_head={config.n_head} is not divisible by tp={tp}")
    if problems:
        raise ValueError(
            "the tensor-parallel plan does not fit the model:\n  - " + "\n  - ".join(problems)
        )
    return resolved


def apply_tp(
    model: nn.Module, mesh: Any, config: TensorConfig, owned: set[str] | None = None
) -> nn.Module:
    """Split ``model``'s layers over the 1-D ``mesh`` (its tensor-parallel ranks) by
    ``config``'s plan (or the default plan); only modules named in ``owned``, when given (a
    pipeline rank's stages)."""
    plan = resolve_plan(model, config.plan or default_plan(model), mesh.size())
    if owned is not None:
        plan = {name: style for name, style in plan.items() if name in owned}
    return apply_tensor_parallel(model, mesh, plan, sequence_parallel=config.sequence_parallel)


def apply_tensor_parallel(
    model: nn.Module, mesh: Any, plan: dict[str, str], *, sequence_parallel: bool
) -> nn.Module:
    """Parallelize ``model``'s planned layers (exact names) over ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if not sequence_parallel:
        styles = {
            n: ColwiseParallel() if s == "colwise" else RowwiseParallel() for n, s in plan.items()
        }
        return parallelize_module(model, mesh, styles)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise ValueError(
            "sequence_parallel needs the model's transformer blocks in model.blocks (an "
            "nn.ModuleList); run without it, or arrange the model that way"
        )
    sequence = Shard(1)
    styles: dict[str, Any] = {}
    for name, style in plan.items():
        styles[name] = (
            ColwiseParallel()
            if style == "colwise"
            else RowwiseParallel(output_layouts=sequence, use_local_output=False)
        )
    for i, block in enumerate(blocks):
        prefix = f"blocks.{i}"
        for child_name, child in block.named_children():
            full = f"{prefix}.{child_name}"
            if isinstance(child, nn.LayerNorm | nn.RMSNorm):
                styles[full] = SequenceParallel()
            elif any(n.startswith(full + ".") for n in plan):
                # attention / MLP: gather the sequence shards before the column-parallel layers
                styles[full] = PrepareModuleInput(
                    input_layouts=(sequence,), desired_input_layouts=(Replicate(),)
                )
    # The residual stream enters the first block whole and is cut into sequence shards; it
    # leaves the last block gathered again, for the (replicated) final norm and head.
    parallelize_module(
        model,
        mesh,
        {
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(sequence,)
            )
        },
    )
    styles[f"blocks.{len(blocks) - 1}"] = PrepareModuleOutput(
        output_layouts=(sequence,), desired_output_layouts=(Replicate(),)
    )
    return parallelize_module(model, mesh, styles)


def _is_gpt(model: nn.Module) -> bool:
    from axon_nb.models.gpt import GPT

    return isinstance(model, GPT)
