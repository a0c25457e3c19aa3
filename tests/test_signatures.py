"""Training options are declared once (``TrainSpec``): the public entry points take each one by
name, with the same default, and every layer below them takes the built spec instead."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

import axon_nb
from axon_nb.spec.train_spec import REQUIRED, TrainSpec, entry_point_options
from axon_nb.train import compare, local, on_cluster, start

FUNCTIONS: dict[str, list[Any]] = {
    "train": [axon_nb.Cluster.train],
    "train_local": [axon_nb.train_local],
    "compare": [axon_nb.Cluster.compare],
    "advise": [axon_nb.advise, axon_nb.Cluster.advise],
}
OPTIONAL_THERE = {("advise", "batch_size")}
"""Required for a run, optional for the advisor (4 samples per rank)."""

BELOW = [on_cluster.train, on_cluster.check_on_cluster, compare.compare, local.run_local,
         start.start_run]  # fmt: skip
"""What the public entry points hand the built spec to."""


@pytest.mark.parametrize(
    ("entry", "fn"),
    [(e, f) for e, fns in FUNCTIONS.items() for f in fns],
    ids=lambda v: getattr(v, "__qualname__", v),  # the same on every xdist worker
)
def test_each_option_is_in_each_signature_with_its_default(entry: str, fn: Any) -> None:
    params = inspect.signature(fn).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{fn.__qualname__} takes **kwargs"
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, f"{fn.__qualname__} takes *args"
    for name, default in entry_point_options()[entry].items():
        assert name in params, f"{fn.__qualname__} lacks the option {name!r}"
        got = params[name].default
        if (entry, name) in OPTIONAL_THERE:
            continue
        want = inspect.Parameter.empty if default is REQUIRED else default
        assert got == want, f"{fn.__qualname__}({name}=...) defaults to {got!r}, not {want!r}"


def test_a_new_option_would_be_noticed() -> None:
    """The check reads the spec: an option only one function has is caught (this fails if the
    declaration is ever bypassed)."""
    options = entry_point_options()
    assert "seed" in options["train"] and "seed" in options["compare"]
    assert "checkpoint_dir" not in options["train_local"]
    assert set(options["advise"]) == {"batch_size", "optimizer", "mixed_precision"}


@pytest.mark.parametrize("fn", BELOW, ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_the_layers_below_take_the_spec_not_the_options(fn: Any) -> None:
    params = inspect.signature(fn).parameters
    assert "spec" in params, f"{fn.__qualname__} does not take the spec"
    assert params["spec"].annotation in ("TrainSpec", TrainSpec)
    options = {f.name for f in dataclasses.fields(TrainSpec)}
    taken = sorted(options & set(params))
    assert not taken, f"{fn.__qualname__} takes the options {taken} one by one"
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{fn.__qualname__} takes **kwargs"
