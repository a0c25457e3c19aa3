"""A model's shape, sizes and activation memory, measured by one forward and backward in this
process: what ``axon_nb.estimate`` predicts memory, communication and step time from.

The model is run whole, on a few samples, layer by layer (the layers a pipeline would cut:
an ``nn.Sequential``'s children or ``pipeline_layers()``; else the model is one layer). For
each layer it records:

- ``params``: parameter count, and ``tp_params``: how many of them a tensor-parallel plan
  splits (the model's default plan, when it has one); ``frozen`` and ``tp_frozen``: how many
  of each have ``requires_grad=False`` (no gradients, no optimizer state);
- ``saved_bytes``: bytes of the tensors autograd saves for backward (activations; parameters
  excluded), per sample;
- ``output_bytes``: bytes of the layer's output per sample (what a pipeline sends on);
- ``expert_params``, ``experts`` and ``routed_bytes``: of its stacked experts modules (a
  mixture of experts), their parameters, their experts, and per sample the hidden vectors
  of the (token, expert) assignments they receive (what expert parallelism sends);
- ``block``: whether it is an entry of an ``nn.ModuleList`` (a transformer block: what
  activation checkpointing wraps and FSDP shards as its own unit);
- ``colwise_in_bytes`` / ``rowwise_out_bytes``: per sample, the inputs of its column-parallel
  linears and the outputs of its row-parallel ones (what tensor parallelism reduces);
- ``colwise_group_bytes``: per sample, the distinct tensors that feed its column-parallel
  linears (what sequence parallelism gathers: q, k and v share one input);
- ``split_fraction``: the share of ``saved_bytes`` that tensor parallelism splits, measured by
  running the layer again with its planned linears narrowed to half their split features
  (0 where the model cannot run so, or has no plan).

And for the whole model: ``backward_extra_bytes`` per sample, the bytes alive at the peak of
forward and backward beyond the saved activations, the parameter gradients alive then (none
when the peak comes at the start of backward, as it does when the loss's gradient is the
largest; a frozen parameter never has one): the gradients of activations and the loss's
temporaries. And ``flops`` per sample ((4 x parameters + 2 x trainable
parameters) x tokens: frozen weights get no gradient; 6 x parameters x tokens when all train;
tokens are the samples where no token count is known).

Example (on a rank, or in any process with torch)::

    profile = model_probe.profile_model(GPT(config), (x[:4], y[:4]), lm_loss)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from axon_nb.parallel.expert_plan import stacked_experts
from axon_nb.rank.observe.probe_passes import head, measure_pass, split_fixed
from axon_nb.rank.observe.split_probe import measure_split
from axon_nb.spec.pretrained_model import PretrainedModel


def profile_model(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Measure ``model`` on ``batch`` (an ``(input, target)`` pair of a few samples).
    Example::

        profile_model(nn.Linear(4, 2), (torch.randn(4, 4), torch.randn(4, 2)), mse)["layers"]
    """
    inputs, target = batch
    samples = _samples(inputs)
    layers = _layers(model)
    plan = _plan(model)
    rows, hooks = _rows(model, layers, plan)
    model.zero_grad(set_to_none=True)
    saved, peak, phase = measure_pass(
        model, layers, inputs, target, loss_fn, forward=_forward, hooks=hooks
    )
    for row, layer_saved in zip(rows, saved, strict=True):
        row["saved_bytes"] = layer_saved / samples
        for key in PER_SAMPLE:
            row[key] = row[key] / samples
    if plan:
        measure_split(model, rows, (inputs, target), loss_fn, plan, layers_of=_layers,
                      forward=_forward, samples=samples)  # fmt: skip
    working = _working_sets(model, layers, rows, batch, loss_fn, peak - sum(saved), phase)
    # FLOPs count the parameters a token meets: of a mixture of experts, its top_k experts
    idle = sum(sum(r.pop("_idle", {}).values()) for r in rows)
    params = sum(r["params"] for r in rows) - idle
    trainable = params - sum(r["frozen"] for r in rows)
    tokens = _tokens(inputs) / samples
    return {
        "layers": rows,
        "param_bytes": _param_bytes(model),
        **working,
        "flops": (4 * params + 2 * trainable) * tokens,
        "tokens_per_sample": tokens,
        "fsdp_units": _fsdp_units(model) if layers == [model] else [],
        "probe_samples": samples,
    }


PER_SAMPLE = ("output_bytes", "colwise_in_bytes", "rowwise_out_bytes", "colwise_group_bytes",
              "routed_bytes")  # fmt: skip
"""A layer row's figures the probe's batch measured whole, kept per sample."""


def _rows(
    model: nn.Module, layers: list[nn.Module], plan: dict[str, str]
) -> tuple[list[dict[str, Any]], list[Any]]:
    """A row per layer (its sizes, whether it is a block) and the forward hooks that fill in
    what the pass measures (outputs, tensor-parallel inputs and outputs, routed tokens)."""
    names = {id(m): n for n, m in model.named_modules()}
    split = [model.get_submodule(name) for name in plan]
    rows = [_layer_row(layer, names, split) for layer in layers]
    listed = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    for layer, row in zip(layers, rows, strict=True):
        row["block"] = any(layer is m for m in listed)
    hooks = [
        layer.register_forward_hook(_record_output(row))
        for layer, row in zip(layers, rows, strict=True)
    ]

    def owner(module: nn.Module) -> dict[str, Any]:
        return next(r for layer, r in zip(layers, rows, strict=True) if _holds(layer, module))

    for name, style in plan.items():
        module = model.get_submodule(name)
        hooks.append(module.register_forward_hook(_record_tp(owner(module), style)))
    for module in model.modules():
        if stacked_experts(module):
            row = owner(module)
            row["expert_params"] += sum(p.numel() for p in module.parameters(recurse=False))
            row["experts"] += module.num_experts
            hooks.append(module.register_forward_hook(_record_routed(row)))
    return rows, hooks


def _working_sets(
    model: nn.Module,
    layers: list[nn.Module],
    rows: list[dict[str, Any]],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    extra: float,
    phase: str,
) -> dict[str, Any]:
    """The working set beyond the saved activations (``extra`` bytes at the main pass's peak,
    in ``phase``), measured at two batch sizes: the part that grows with the samples
    (activation gradients, the loss's temporaries) and the part that does not (a stacked
    experts weight's gradient pieces before they are summed). And all of it again under bf16
    autocast, which keeps some activations in fp32 and saves bf16 copies of the weights
    (their per-layer figures go into ``rows``)."""
    inputs, target = batch
    samples = _samples(inputs)
    per_sample, fixed = max(0, extra) / samples, 0.0
    half_extra: tuple[float, float] = (0.0, 0.0)
    half_phase = phase
    if samples >= 2:
        fewer = samples // 2
        small = (head(inputs, fewer), head(target, fewer))
        saved_small, peak_small, _ = measure_pass(model, layers, *small, loss_fn, forward=_forward)
        per_sample, fixed = split_fixed(extra, peak_small - sum(saved_small), samples, fewer)
        bf16 = torch.bfloat16
        try:
            full_h, peak_h, half_phase = measure_pass(
                model, layers, inputs, target, loss_fn, forward=_forward, dtype=bf16
            )
            small_h, peak_small_h, _ = measure_pass(
                model, layers, *small, loss_fn, forward=_forward, dtype=bf16
            )
        except (RuntimeError, NotImplementedError):  # an op CPU autocast cannot run: no bf16
            full_h = small_h = []  # figures (predictions then halve the fp32 ones)
            peak_h = peak_small_h = 0
        for row, big, little in zip(rows, full_h, small_h, strict=False):
            row["half_saved_bytes"], row["half_saved_fixed"] = split_fixed(
                big, little, samples, fewer
            )
        if full_h:
            half_extra = split_fixed(
                peak_h - sum(full_h), peak_small_h - sum(small_h), samples, fewer
            )
    return {
        "backward_extra_bytes": per_sample,
        "backward_fixed_bytes": fixed,
        "half_backward_extra_bytes": half_extra[0],
        "half_backward_fixed_bytes": half_extra[1],
        "working_set_phase": phase,
        "half_working_set_phase": half_phase,
    }


def _forward(
    model: nn.Module, layers: list[nn.Module], inputs: Any, target: Any, loss_fn: Any
) -> torch.Tensor:
    """The loss, through the layers one after another (as a pipeline runs them) where the
    model has layers, else through the model."""
    if isinstance(inputs, Mapping):  # model(**batch), as training calls it
        from axon_nb.rank.training.model_loss import LossRule

        return LossRule(loss_fn, model).forward(model, inputs)
    if loss_fn is None:  # the model computes its own loss
        return model(inputs, target)
    if layers == [model]:
        return loss_fn(model(inputs), target)
    x = inputs
    for layer in layers:
        x = layer(x)
    return loss_fn(x, target)


def _layers(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        return list(model)
    layers = getattr(model, "pipeline_layers", None)
    return list(layers()) if callable(layers) else [model]


def _plan(model: nn.Module) -> dict[str, str]:
    from axon_nb.parallel.tensor import default_plan, resolve_plan

    try:
        return resolve_plan(model, default_plan(model), 1)
    except ValueError:  # no plan for this model: nothing is split
        return {}


def _layer_row(layer: nn.Module, names: dict[int, str], split: list[nn.Module]) -> dict[str, Any]:
    planned = [
        p for m in layer.modules() if any(m is s for s in split)
        for p in m.parameters(recurse=False)
    ]  # fmt: skip
    stacked = {
        id(p) for m in layer.modules() if stacked_experts(m) for p in m.parameters(recurse=False)
    }
    return {
        "name": names.get(id(layer), type(layer).__name__),
        "params": sum(p.numel() for p in layer.parameters()),
        "tp_params": sum(p.numel() for p in planned),
        "frozen": sum(p.numel() for p in layer.parameters() if not p.requires_grad),
        "largest_param": max((p.numel() for p in layer.parameters() if p.requires_grad), default=0),
        "largest_dense_param": max(
            (p.numel() for p in layer.parameters() if p.requires_grad and id(p) not in stacked),
            default=0,
        ),
        "tp_frozen": sum(p.numel() for p in planned if not p.requires_grad),
        "output_bytes": 0,
        "colwise_in_bytes": 0,
        "rowwise_out_bytes": 0,
        "colwise_group_bytes": 0,
        "expert_params": 0,
        "experts": 0,
        "routed_bytes": 0,
        "split_fraction": 0.0,
        "_inputs": {},
    }


def _record_output(row: dict[str, Any]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        row["output_bytes"] += _nbytes(output)
        row["colwise_group_bytes"] = sum(row.pop("_inputs", {}).values())

    return hook


def _record_routed(row: dict[str, Any]) -> Callable[..., None]:
    """Hook of an experts module, called ``(tokens, top_k_index, top_k_weights)``: the bytes
    of the hidden vectors its assignments carry."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        tokens, index = args[0], args[1]
        row["routed_bytes"] += index.numel() * tokens.shape[-1] * tokens.element_size()
        idle = 1 - index.shape[1] / module.num_experts  # share of the experts a token skips
        row.setdefault("_idle", {})[id(module)] = idle * sum(
            p.numel() for p in module.parameters(recurse=False)
        )

    return hook


def _record_tp(row: dict[str, Any], style: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if style == "colwise":
            row["colwise_in_bytes"] += _nbytes(args[0])
            row["_inputs"][args[0].untyped_storage().data_ptr()] = _nbytes(args[0])
        else:
            row["rowwise_out_bytes"] += _nbytes(output)

    return hook


def _holds(layer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in layer.modules())


def _param_bytes(model: nn.Module) -> int:
    return next((p.element_size() for p in model.parameters()), 4)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return 0


def _fsdp_units(model: nn.Module) -> list[tuple[int, int]]:
    """(parameters, trainable parameters) of the submodules FSDP makes units of."""
    from axon_nb.parallel.fsdp import wrap_targets

    return [
        (sum(p.numel() for p in unit.parameters()),
         sum(p.numel() for p in unit.parameters() if p.requires_grad))
        for unit in wrap_targets(model, None, None)
    ]  # fmt: skip


def _first(inputs: Any) -> torch.Tensor:
    """The input tensor that counts samples and tokens (a mapping's ``input_ids`` or first)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping):
        return inputs.get("input_ids", next(iter(inputs.values())))
    return next(iter(inputs))


def _samples(inputs: Any) -> int:
    return int(_first(inputs).shape[0])


def _tokens(inputs: Any) -> int:
    """Token count of integer inputs (batch x sequence); else the samples."""
    first = _first(inputs)
    if not first.is_floating_point() and first.dim() >= 2:
        return int(first.shape[0] * first.shape[1])
    return int(first.shape[0])


def profile_from(model: Any, data: Any, loss: Any = None, samples: int = 4) -> dict[str, Any]:
    """:func:`profile_model` from ``train``'s own arguments: ``model`` (a module or a callable
    building one, built here, on this process's CPU), ``data`` (a map-style dataset or a
    callable returning one) and ``loss``; the first ``samples`` items make the batch."""
    import copy

    from torch.utils.data import default_collate

    from axon_nb.rank.data.shards import resolve_dataset

    if isinstance(model, PretrainedModel):
        from axon_nb.rank.training import meta_init  # the whole model: every weight read

        built = meta_init.load_whole(model)
    else:
        torch.manual_seed(0)  # a model built here is the same model at every profile
        built = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    if not isinstance(built, nn.Module):
        raise TypeError(
            f"model must be an nn.Module or a callable returning one; got {type(built).__name__}"
        )
    if data is None:
        return profile_model(built.cpu(), _random_tokens(built, samples), loss)
    dataset = resolve_dataset(data)
    if not hasattr(dataset, "__len__") or len(dataset) < samples:
        raise ValueError(
            f"profiling needs a map-style dataset of at least {samples} items (the probe "
            "runs one batch of them)"
        )
    batch = default_collate([dataset[i] for i in range(samples)])
    if isinstance(batch, Mapping):  # model(**batch), with labels among its keys
        torch.manual_seed(0)
        return profile_model(built.cpu(), (batch, None), loss)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise TypeError("each data item must be an (input, target) pair or a mapping")
    torch.manual_seed(0)
    return profile_model(built.cpu(), (batch[0], batch[1]), loss)


def _random_tokens(model: nn.Module, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token pairs for a model with ``config.vocab_size`` and ``config.block_size``."""
    config = getattr(model, "config", None)
    vocab, block = getattr(config, "vocab_size", None), getattr(config, "block_size", None)
    if not (isinstance(vocab, int) and isinstance(block, int)):
        raise TypeError(
            f"pass data= (a few samples to probe {type(model).__name__} with): only models with "
            "config.vocab_size and config.block_size get random tokens"
        )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(vocab, (samples, block), generator=g)
    return x, torch.randint(vocab, (samples, block), generator=g)


def main() -> None:
    """``python -m axon_nb.rank.observe.model_probe IN OUT``: the arguments of :func:`profile_from`,
    pickled in IN by cloudpickle; the profile written to OUT as JSON. How the kernel profiles
    a model without a cluster, and without importing torch itself."""
    import json
    import sys

    import cloudpickle

    with open(sys.argv[1], "rb") as f:
        kwargs = cloudpickle.load(f)
    try:
        profile = profile_from(**kwargs)
    except (TypeError, ValueError) as e:  # the user's input: one line for the kernel's error
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    with open(sys.argv[2], "w") as f:
        json.dump(profile, f)


if __name__ == "__main__":
    main()
