"""Pretrained weights without a full copy per rank: build on the meta device, lay out, then
read each rank's own part of the safetensors files.

For ``model=axon_nb.pretrained(cls, path)`` every rank

1. builds the architecture inside :func:`parameters_on_meta`: parameters take no memory,
   buffers computed in ``__init__`` (Llama's rotary ``inv_freq``) are real;
2. checks that every parameter has a tensor of its shape in the files (:func:`build`);
3. lays the model out as any other (``axon_nb.parallel.parallelize``): tensor parallelism
   and FSDP turn meta parameters into meta DTensors, a pipeline keeps its stages;
4. makes each part it trains real on its device and fills it (:func:`materialize`, which
   ``parallelize`` calls before DDP or ZeRO wrap a part, after FSDP shards it): a DTensor
   reads only its local shard, ``preadv`` straight into the shard's memory.

A host so holds about one copy of the weights (plus the page cache), however many ranks
run on it. Every parameter comes from the files, so no result depends on random init.
Example (what the training loop does)::

    model = build(spec)
    parallel = parallelize(model, dims, config, device, materialize=loader(spec, model, device))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from axon_nb.parallel.activation_checkpoint import canonical_name
from axon_nb.rank.checkpoint.safetensors_slices import SafetensorsFiles
from axon_nb.spec.pretrained_model import MODEL_OPTIONS, PretrainedModel

_Store = dict[str, Any]
"""A module's ``_parameters`` or ``_buffers``: tensors by name (None for a slot left empty)."""

_SHOWN = 5
"""Names listed in an error before "and N more"."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real.

    ``nn.Module.register_parameter`` (which every ``module.weight = nn.Parameter(...)`` goes
    through) is wrapped for the duration. Example::

        with parameters_on_meta():
            layer = nn.Linear(4096, 4096)  # layer.weight.is_meta
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # for the block
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # put back


def build(spec: PretrainedModel) -> nn.Module:
    """``spec``'s model with its parameters on the meta device, checked against the files:
    raises ``ValueError`` naming every parameter the files lack or hold in another shape."""
    files = SafetensorsFiles(spec.files)
    with parameters_on_meta():
        model = _transformers_model(spec, files) if spec.transformers else spec.build()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"pretrained(build, path): build must return an nn.Module, got {type(model).__name__}"
        )
    _check_files(model, files, spec)
    return model


def loader(spec: PretrainedModel, root: nn.Module, device: torch.device) -> Callable[[Any], None]:
    """``part -> None``: :func:`materialize` of a part of ``root`` (the whole model, or one
    pipeline stage) from ``spec``'s files; what ``parallelize(materialize=)`` takes."""
    files = SafetensorsFiles(spec.files)
    return lambda part: materialize(part, root, files, device)


def load_whole(spec: PretrainedModel, device: torch.device | str = "cpu") -> nn.Module:
    """``spec``'s whole model on ``device``, every weight read (no layout): the model a
    probe or a single process uses."""
    model = build(spec)
    materialize(model, model, SafetensorsFiles(spec.files), torch.device(device))
    return model


def materialize(
    part: nn.Module, root: nn.Module, files: SafetensorsFiles, device: torch.device
) -> None:
    """Make ``part``'s meta parameters real on ``device`` and fill them, and its persistent
    buffers the files hold, from ``files``; other tensors of ``part`` move to ``device``.

    ``part`` is ``root`` or a submodule of it (a pipeline stage), laid out or not: a DTensor
    parameter reads only this rank's shard. Parameters shared by several modules (tied
    embeddings) stay shared.
    """
    keys = _keys_by_tensor(root, files)  # by identity: named before anything is replaced
    slots: list[tuple[_Store, str, int]] = [
        (store, name, id(tensor))
        for module in part.modules()
        for store in (module._parameters, module._buffers)
        for name, tensor in store.items()
        if tensor is not None
    ]
    unread = [
        _names(root, old)
        for old in {old for store, name, old in slots if store[name].is_meta}
        if old not in keys
    ]
    if unread:  # a buffer built on meta that the files do not hold would stay garbage
        raise ValueError(f"{_listed(unread)}: on the meta device and not in the files")
    # nn.Module.to_empty, but buffers keep their values (what FSDP documents for meta init)
    part._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    made: dict[int, torch.Tensor] = {}
    for store, name, old in slots:
        if old in made:  # _apply gave each module its own copy of a shared parameter
            store[name] = made[old]
        else:
            made[old] = store[name]
    with torch.no_grad():
        for old, tensor in made.items():
            if old in keys:
                _fill(tensor, keys[old], files)


def _fill(tensor: torch.Tensor, key: str, files: SafetensorsFiles) -> None:
    """Read ``tensor``'s part of checkpoint tensor ``key``: all of it, or a DTensor's shard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stored = files.tensors[key].shape
    if stored != tuple(tensor.shape):
        raise ValueError(f"{key}: {stored} in the files, {tuple(tensor.shape)} in the model")
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"{key}: local shard {tuple(local.shape)} is not {shape}")
        files.read_into(key, local, offset)
    else:
        files.read_into(key, tensor, (0,) * tensor.dim())


def _keys_by_tensor(root: nn.Module, files: SafetensorsFiles) -> dict[int, str]:
    """``id(tensor) -> key in the files`` for ``root``'s parameters and persistent buffers."""
    prefix = getattr(root, "base_model_prefix", "") or ""
    keys: dict[int, str] = {}
    for name, tensor in _named_tensors(root):
        if id(tensor) not in keys:
            key = _key(canonical_name(name), files, prefix)
            if key is not None:
                keys[id(tensor)] = key
    return keys


def _named_tensors(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (each name of a shared one) and persistent buffer of ``root``."""
    yield from root.named_parameters(remove_duplicate=False)
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _key(name: str, files: SafetensorsFiles, prefix: str) -> str | None:
    """The key of parameter ``name`` in the files: the same name, or the name with or
    without the model's ``base_model_prefix`` (a head's checkpoint read into its base model,
    or a base model's into a model with a head)."""
    candidates = [name]
    if prefix:
        lead = f"{prefix}."
        candidates.append(name[len(lead) :] if name.startswith(lead) else lead + name)
    return next((c for c in candidates if c in files), None)


def _check_files(model: nn.Module, files: SafetensorsFiles, spec: PretrainedModel) -> None:
    keys = _keys_by_tensor(model, files)
    missing, misfits = [], []
    for param in {id(p): p for p in model.parameters()}.values():
        key = keys.get(id(param))
        if key is None:
            missing.append(_names(model, id(param)))
        elif files.tensors[key].shape != tuple(param.shape):
            stored = files.tensors[key].shape
            misfits.append(f"{key}: {stored} in the files, {tuple(param.shape)} in the model")
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) have no tensor in the files: {_listed(missing)}. "
            "pretrained() reads every parameter from the files; for layers the checkpoint "
            "lacks (e.g. a new classification head) use model=lambda: cls.from_pretrained("
            "path), which initialises them randomly, or save the whole model and pass that"
        )
    if misfits:
        problems.append(
            f"{len(misfits)} tensor(s) differ in shape from the model's: {_listed(misfits)} "
            "(another architecture's or config's checkpoint?)"
        )
    if problems:
        raise ValueError(f"{spec!r} does not fit its model:\n  - " + "\n  - ".join(problems))


def _names(root: nn.Module, identity: int) -> str:
    names = [canonical_name(n) for n, t in _named_tensors(root) if id(t) == identity]
    return " = ".join(names) if names else "?"


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _transformers_model(spec: PretrainedModel, files: SafetensorsFiles) -> nn.Module:
    """``cls.from_config`` as ``cls.from_pretrained(path, **options)`` would build it: the
    same config overrides, attention implementation and dtype (``"auto"``: the config's,
    else the files' first floating-point dtype)."""
    import transformers

    cls = spec.build
    if isinstance(cls, str):
        cls = getattr(transformers, cls, None)
        if cls is None:
            raise ValueError(f"transformers {transformers.__version__} has no class {spec.build!r}")
    options = dict(spec.options)
    model_options = {k: options.pop(k) for k in MODEL_OPTIONS if k in options}
    config_class = getattr(cls, "config_class", None) or transformers.AutoConfig
    config, unused = config_class.from_pretrained(spec.path, return_unused_kwargs=True, **options)
    if unused:
        raise ValueError(
            f"pretrained(): {sorted(unused)} are neither {' nor '.join(MODEL_OPTIONS)} nor "
            f"settings of {type(config).__name__}"
        )
    if model_options.get("dtype", "auto") == "auto":
        model_options["dtype"] = config.dtype or files.floating_dtype()
    make = getattr(cls, "from_config", None) or cls._from_config
    return make(config, **model_options)
