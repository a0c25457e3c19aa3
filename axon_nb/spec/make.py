"""``make_spec``: a :class:`~axon_nb.spec.train_spec.TrainSpec` from ``train()``'s keywords,
normalized (strategy, optimizer, tracking, paths) and checked (``spec/validation.py``), every
bad option listed at once. What every entry point (``Cluster.train``, ``Cluster.compare``,
``train_local``) calls before anything runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from axon_nb.spec import tracking_options
from axon_nb.spec.train_spec import OPTIMIZERS, TrainSpec
from axon_nb.spec.validation import problems
from axon_nb.strategies import Strategy, resolve_strategy


def make_spec(default_strategy: type[Strategy], **kwargs: Any) -> TrainSpec:
    """Build a :class:`TrainSpec` from ``train()`` keywords, raising ``ValueError`` that lists
    every bad option (``axon_nb.spec.validation``). Example::

        spec = make_spec(DDP, model=make_model, data=ds, steps=100, batch_size=32)
    """
    kwargs["strategy"] = resolve_strategy(kwargs.get("strategy"), default_strategy)
    kwargs.update(tracking_options.normalize(kwargs))
    if kwargs.get("resume") and kwargs.get("optimizer") is None:
        kwargs["optimizer"] = ("adamw", {})  # a resumed run keeps its optimizer's settings
    else:
        kwargs["optimizer"] = _optimizer(kwargs.get("optimizer"))
    if kwargs.get("checkpoint_dir") is not None:
        kwargs["checkpoint_dir"] = os.path.abspath(os.fspath(kwargs["checkpoint_dir"]))
    spec = TrainSpec(**kwargs)
    errors = problems(spec)
    if errors:
        raise ValueError("invalid training arguments:\n  - " + "\n  - ".join(errors))
    return spec


def _optimizer(value: Any) -> tuple[str, dict[str, Any]] | Callable[..., Any]:
    if value is None:
        return ("adamw", {"lr": 1e-3})
    if isinstance(value, str):
        value = (value, {})
    if isinstance(value, tuple | list) and len(value) == 2 and isinstance(value[0], str):
        name, kwargs = value[0].lower(), dict(value[1] or {})
        if name not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {value[0]!r}: use one of {', '.join(sorted(OPTIMIZERS))}, "
                "or pass a callable `params -> torch.optim.Optimizer`"
            )
        return (name, kwargs)
    if callable(value):
        return value
    raise ValueError(
        f"optimizer must be a (name, kwargs) pair such as ('adamw', {{'lr': 3e-4}}) or a "
        f"callable `params -> Optimizer`, got {value!r}"
    )
