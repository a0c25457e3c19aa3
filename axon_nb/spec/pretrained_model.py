"""``pretrained(cls, path)``: a model whose weights come from safetensors files, described
torch-free so the kernel can check it and send it down.

``cluster.train(model=axon_nb.pretrained(AutoModelForCausalLM, path), strategy=FSDP())``
builds the architecture on every rank with its parameters on the meta device (no memory),
lays it out (tensor parallel, pipeline cut, FSDP shards), and only then reads each rank's own
part from the files (``axon_nb.rank.training.meta_init``). A host so holds about one copy of
the weights however many ranks it runs, where ``model=lambda: cls.from_pretrained(path)``
builds the whole model on every rank first. Example::

    axon_nb.pretrained(AutoModelForCausalLM, "out/llama")              # a save_pretrained directory
    axon_nb.pretrained(AutoModelForCausalLM, "out/llama", dtype="bfloat16")
    axon_nb.pretrained(make_model, "weights.safetensors")              # any torch model
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
"""The names ``save_pretrained`` gives the config, the weights and the index of sharded weights."""

MODEL_OPTIONS = ("dtype", "attn_implementation")
"""``from_pretrained`` options the model takes; every other option overrides the config."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainedModel:
    """A model built on every rank from ``build`` and filled from the safetensors ``files``."""

    build: Any
    """A transformers model class (``AutoModelForCausalLM``, ``LlamaForCausalLM``) or its
    name in ``transformers``; or a zero-argument callable returning an ``nn.Module`` whose
    parameter names are the files' keys."""
    path: str
    """The absolute path given: a ``save_pretrained`` directory, or (with a callable) a
    ``.safetensors`` file or a directory holding ``model.safetensors[.index.json]``."""
    files: tuple[str, ...]
    """The safetensors files that hold the weights (absolute paths)."""
    options: dict[str, Any] = field(default_factory=dict)
    """``from_pretrained`` keyword arguments: ``dtype``, ``attn_implementation`` and config
    overrides (transformers models only)."""

    @property
    def transformers(self) -> bool:
        """Built by a transformers class from its config (else by calling ``build``)."""
        return isinstance(self.build, str) or _is_transformers_class(self.build)

    def __repr__(self) -> str:
        name = self.build if isinstance(self.build, str) else getattr(self.build, "__name__", "?")
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"pretrained({name}, {self.path!r}{options})"


def pretrained(build: Any, path: str | os.PathLike[str], **options: Any) -> PretrainedModel:
    """A model for ``train(model=...)`` whose ranks read only their own part of the weights.

    ``build``: a transformers model class (or its name in ``transformers``) and ``path`` a
    ``save_pretrained`` directory (``config.json`` and safetensors weights, sharded or not);
    ``options`` are ``from_pretrained``'s (``dtype``, ``attn_implementation``, config
    overrides). Or ``build`` a zero-argument callable returning any ``nn.Module`` and
    ``path`` a ``.safetensors`` file of its ``state_dict()`` (or a directory with
    ``model.safetensors``). The path must be readable on every rank's host. Raises
    ``ValueError`` at once when the path holds no such files. Example::

        cluster.train(model=axon_nb.pretrained(AutoModelForCausalLM, "out/llama"),
                      data=ds, strategy=FSDP(), steps=100, batch_size=8)
    """
    where = os.path.abspath(os.fspath(path))
    if isinstance(build, str):
        if not build.isidentifier():
            raise ValueError(
                f"pretrained(build, path): a string names a transformers class such as "
                f"'AutoModelForCausalLM'; got {build!r}"
            )
    elif not callable(build):
        raise ValueError(
            f"pretrained(build, path): build must be a transformers model class (e.g. "
            f"AutoModelForCausalLM) or a callable returning an nn.Module; got {build!r}"
        )
    elif hasattr(build, "from_pretrained") and not _is_transformers_class(build):
        raise ValueError(
            f"{build.__name__} has from_pretrained but no from_config to build it from a "
            "config without weights: pass a transformers model class such as "
            "AutoModelForCausalLM, or model=lambda: cls.from_pretrained(path)"
        )
    if isinstance(build, str) or _is_transformers_class(build):
        files = _transformers_files(where)
    else:
        if options:
            raise ValueError(
                f"options {sorted(options)} are from_pretrained's, for transformers classes; "
                "a callable builds the model itself: give them to it"
            )
        files = _weight_files(where)
    return PretrainedModel(build=build, path=where, files=files, options=dict(options))


def _is_transformers_class(build: Any) -> bool:
    """A class that builds from a config (``from_config``, or ``_from_config`` as a concrete
    transformers class has it) and loads with ``from_pretrained``."""
    return (
        isinstance(build, type)
        and callable(getattr(build, "from_pretrained", None))
        and any(callable(getattr(build, m, None)) for m in ("from_config", "_from_config"))
    )


def _transformers_files(where: str) -> tuple[str, ...]:
    if not os.path.isdir(where):
        raise ValueError(
            f"{where} is not a directory: pretrained(cls, path) reads a local save_pretrained "
            "directory (config.json and model.safetensors). For a Hub model download it "
            "first, e.g. huggingface_hub.snapshot_download(repo_id), and pass that path"
        )
    if not os.path.isfile(os.path.join(where, CONFIG_FILE)):
        raise ValueError(
            f"{where} has no {CONFIG_FILE}: pass the directory model.save_pretrained(...) wrote"
        )
    return _weight_files(where)


def _weight_files(where: str) -> tuple[str, ...]:
    """The safetensors files at ``where``: the file itself, or a directory's weights."""
    if os.path.isfile(where):
        if not where.endswith(".safetensors"):
            raise ValueError(
                f"{where} is not a .safetensors file; save the weights with "
                "safetensors.torch.save_model(model, path) or save_pretrained"
            )
        return (where,)
    if not os.path.isdir(where):
        raise ValueError(f"{where} does not exist")
    index = os.path.join(where, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(where, n))]
        if not names or missing:
            raise ValueError(
                f"{index} names weight files that are not there: {missing or 'none at all'}"
            )
        return tuple(os.path.join(where, n) for n in names)
    single = os.path.join(where, WEIGHTS_FILE)
    if os.path.isfile(single):
        return (single,)
    others = sorted(n for n in os.listdir(where) if n.endswith((".bin", ".pt", ".pth")))
    hint = (
        f" (it has {', '.join(others)}: load it once and save it again with "
        "save_pretrained, which writes safetensors)"
        if others
        else ""
    )
    raise ValueError(f"{where} has no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
