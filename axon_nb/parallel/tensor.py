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
sequence shards. That needs the transformer blocks: ``model.blocks``, or the ``ModuleList``
holding the planned layers (a transformers model's ``model.layers``); their norm layers are
found by class name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from torch import nn

from axon_nb.parallel.module_patterns import matching
from axon_nb.spec.parallel_config import TP_STYLES as STYLES
from axon_nb.spec.parallel_config import TensorConfig

if TYPE_CHECKING:
    from axon_nb.models.gpt import GPT


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
    layers, else the reference GPT's (attention q/k/v column, out row; MLP up column, down row;
    a mixture-of-experts GPT's MLP is left to expert parallelism)."""
    plan = {
        name: "colwise" if isinstance(m, ColumnParallelLinear) else "rowwise"
        for name, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    }
    if plan:
        return plan
    if _is_gpt(model):
        plan = {
            "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise",
            "blocks.*.attn.out": "rowwise",
        }
        if not model.config.experts:  # (experts: ExpertParallel's)
            plan.update({"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"})
        return plan
    raise ValueError(
        f"no tensor-parallel plan for {type(model).__name__}: pass TensorParallel(plan={{module "
        "name pattern: 'colwise' | 'rowwise'}}), or build the model with ColumnParallelLinear / "
        "RowParallelLinear layers"
    )


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The plan a model carries (``plan="auto"``): a transformers model's ``_tp_plan``, else
    its config's ``base_model_tp_plan`` under its ``base_model_prefix``."""
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else model
    plan = getattr(inner, "_tp_plan", None)
    if not plan:
        base = getattr(getattr(inner, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(inner, "base_model_prefix", "")
        plan = {f"{prefix}.{k}" if prefix and hasattr(inner, prefix) else k: v
                for k, v in base.items()}  # fmt: skip
    if not plan:
        raise ValueError(
            f"plan='auto' takes the model's own tensor-parallel plan, but {type(inner).__name__} "
            "has none (no _tp_plan or config.base_model_tp_plan): pass TensorParallel(plan="
            "{module name pattern: 'colwise' | 'rowwise'})"
        )
    if inner is not model:  # a PEFT wrapper: its module names lead to the inner model
        outer = next(n for n, m in model.named_modules() if m is inner)
        plan = {f"{outer}.{k}": v for k, v in plan.items()}
    return dict(plan)


def resolve_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> dict[str, Any]:
    """Exact module names for ``plan``'s patterns, checked: every pattern matches a module the
    style fits, style names are known, and the split dimensions divide by ``tp``."""
    modules = dict(model.named_modules())
    resolved: dict[str, Any] = {}
    problems = []
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in STYLES:
            problems.append(f"{pattern!r}: style must be one of {', '.join(STYLES)} or a torch "
                            f"ParallelStyle, got {style!r}")  # fmt: skip
            continue
        names, problem = matching(modules, pattern)
        if problem:
            problems.append(problem)
        for name in names:
            problem = _misfit(name, modules[name], style, tp)
            if problem:
                problems.append(problem)
            resolved[name] = style
    problems += _head_problems(model, tp)
    if problems:
        raise ValueError(
            "the tensor-parallel plan does not fit the model:\n  - " + "\n  - ".join(problems)
        )
    return resolved


def _misfit(name: str, module: nn.Module, style: Any, tp: int) -> str | None:
    """Why ``style`` cannot split ``module`` over ``tp`` ranks, or None."""
    if not isinstance(style, str):
        return None  # the user's ParallelStyle object: torch checks it when applied
    if style.startswith("embedding_"):
        if not isinstance(module, nn.Embedding):
            return f"{name} is a {type(module).__name__}, not an nn.Embedding ({style})"
        size = module.num_embeddings if style == "embedding_rowwise" else module.embedding_dim
        what = "rows (vocabulary)" if style == "embedding_rowwise" else "columns"
        return f"{name} has {size} {what}, not divisible by tp={tp}" if size % tp else None
    if not isinstance(module, nn.Linear):
        return f"{name} is a {type(module).__name__}, not an nn.Linear"
    columns = style.startswith("colwise")
    features = module.out_features if columns else module.in_features
    if features % tp:
        kind = "output" if columns else "input"
        return f"{name} has {features} {kind} features, not divisible by tp={tp}"
    return None


def _head_problems(model: nn.Module, tp: int) -> list[str]:
    """Attention heads must split evenly: the reference GPT's, a transformers config's."""
    if _is_gpt(model):
        n_head = model.config.n_head
        return [f"n_head={n_head} is not divisible by tp={tp}"] if n_head % tp else []
    config = getattr(model, "config", None)
    problems = []
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            problems.append(f"{key}={heads} is not divisible by tp={tp}")
    return problems


def parallel_style(style: Any, *, sequence_parallel: bool = False) -> Any:
    """The torch ``ParallelStyle`` for a plan entry (an object is used as it is).

    - ``colwise``: output features split, output stays split;
    - ``rowwise``: input features split, partial outputs summed (with ``sequence_parallel``:
      reduce-scattered to sequence shards);
    - ``colwise_rep`` / ``colwise_gather_output``: column split, output gathered whole;
    - ``rowwise_rep``: a whole input is split here, partial outputs summed;
    - ``embedding_rowwise``: the vocabulary split, lookups summed; ``embedding_colwise``: the
      embedding dimension split, gathered whole.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, str):
        return style
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        if sequence_parallel:
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_rep", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def apply_tp(
    model: nn.Module, mesh: Any, config: TensorConfig, owned: set[str] | None = None
) -> nn.Module:
    """Split ``model``'s layers over the 1-D ``mesh`` (its tensor-parallel ranks) by
    ``config``'s plan (or the default plan); only modules named in ``owned``, when given (a
    pipeline rank's stages)."""
    given = config.plan or default_plan(model)
    # (the one string a plan may be is "auto": TensorConfig checks)
    plan = resolve_plan(model, model_plan(model) if isinstance(given, str) else given, mesh.size())
    if owned is not None:
        plan = {name: style for name, style in plan.items() if name in owned}
    return apply_tensor_parallel(model, mesh, plan, sequence_parallel=config.sequence_parallel)


def apply_tensor_parallel(
    model: nn.Module, mesh: Any, plan: dict[str, str], *, sequence_parallel: bool
) -> nn.Module:
    """Parallelize ``model``'s planned layers (exact names) over ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    if not sequence_parallel:
        return parallelize_module(model, mesh, {n: parallel_style(s) for n, s in plan.items()})
    prefix, blocks = transformer_blocks(model, plan)
    sequence = Shard(1)
    styles: dict[str, Any] = {}
    for name, style in plan.items():
        styles[name] = parallel_style(style, sequence_parallel=True)
    gathered = []  # attention and MLP: the sequence shards are gathered before them
    for i, block in enumerate(blocks):
        for child_name, child in block.named_children():
            full = f"{prefix}.{i}.{child_name}"
            if "Norm" in type(child).__name__:  # LayerNorm, RMSNorm, LlamaRMSNorm, ...
                styles[full] = SequenceParallel()
            elif any(n.startswith(full + ".") for n in plan):
                gathered.append(child)
    # The residual stream enters the first block whole and is cut into sequence shards; it
    # leaves the last block gathered again, for the (replicated) final norm and head.
    parallelize_module(
        model,
        mesh,
        {
            f"{prefix}.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(sequence,)
            )
        },
    )
    styles[f"{prefix}.{len(blocks) - 1}"] = PrepareModuleOutput(
        output_layouts=(sequence,), desired_output_layouts=(Replicate(),)
    )
    parallelize_module(model, mesh, styles)
    for module in gathered:
        module.register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    return model


def transformer_blocks(model: nn.Module, plan: dict[str, Any]) -> tuple[str, nn.ModuleList]:
    """``(name, blocks)``: ``model.blocks``, else the ``ModuleList`` whose entries hold the
    planned layers (a transformers model's ``model.layers``). ``ValueError`` if none does."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return "blocks", blocks
    for name, module in model.named_modules():
        listed = isinstance(module, nn.ModuleList) and len(module) and name
        if listed and any(key.startswith(f"{name}.") for key in plan):
            return name, module
    raise ValueError(
        "sequence_parallel needs the model's transformer blocks: an nn.ModuleList whose "
        "entries hold the plan's layers (model.blocks, or a transformers model's layers); "
        "run without it, or arrange the model that way"
    )


def _gather_sequence(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the hidden states (first argument, or ``hidden_states=`` as
    transformers blocks pass them to attention) gathered whole from their sequence shards."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(x: Any) -> Any:
        return x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor) else x

    if args:
        return (whole(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
    return args, kwargs


def _is_gpt(model: nn.Module) -> TypeGuard[GPT]:
    from axon_nb.models.gpt import GPT

    return isinstance(model, GPT)
