"""The evaluation options of a training run (``eval_data``, ``eval_every``, ``metrics``) and of
``cluster.evaluate``, checked on the kernel before anything runs. Pure Python.

Example::

    problems(ds, 50, {"acc": accuracy})   # []
    problems(None, 50, None)              # ["eval_every=50 needs eval_data=..."]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

RESERVED = ("step", "loss", "samples")
"""Keys of an evaluation result that a metric cannot be named."""


def problems(
    eval_data: Any, eval_every: Any, metrics: Mapping[str, Callable[..., Any]] | None
) -> list[str]:
    """What is wrong with these options (empty when nothing is)."""
    errors = []
    if eval_every is not None and (
        isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1
    ):
        errors.append(f"eval_every must be an integer >= 1 (steps), got {eval_every!r}")
    if eval_data is None:
        given = [n for n, v in (("eval_every", eval_every), ("metrics", metrics)) if v]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            errors.append(
                f"{' and '.join(given)} {verb} eval_data=: the dataset (or a callable returning "
                "one) to evaluate, e.g. eval_data=val_ds"
            )
    elif not callable(eval_data) and not hasattr(eval_data, "__getitem__"):
        errors.append(
            f"eval_data must be a map-style dataset (with __getitem__ and __len__) or a "
            f"callable returning one, got {type(eval_data).__name__}"
        )
    return errors + metric_problems(metrics)


def metric_problems(metrics: Any) -> list[str]:
    """What is wrong with ``metrics``: a Mapping of names to ``fn(output, target) -> scalar``."""
    if metrics is None:
        return []
    if not isinstance(metrics, Mapping):
        return [
            f"metrics must be a dict of names to fn(output, target) -> scalar, e.g. "
            f"{{'acc': accuracy}}, got {type(metrics).__name__}"
        ]
    errors = []
    bad = [k for k, fn in metrics.items() if not isinstance(k, str) or not callable(fn)]
    if bad:
        errors.append(
            f"metrics must map names to callables fn(output, target) -> scalar; {bad} do not"
        )
    taken = [k for k in metrics if k in RESERVED]
    if taken:
        errors.append(
            f"metrics cannot be named {taken}: {', '.join(RESERVED)} are the result's own keys"
        )
    return errors
