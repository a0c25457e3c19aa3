"""Training options are declared once (``TrainSpec``); every function that takes them has an
explicit signature carrying each one, with the same default."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import axon_nb
from axon_nb.spec.train_spec import REQUIRED, entry_point_options
from axon_nb.train.compare import compare
from axon_nb.train.on_cluster import train

FUNCTIONS: dict[str, list[Any]] = {
    "train": [train, axon_nb.Cluster.train],
    "train_local": [axon_nb.train_local],
    "compare": [compare, axon_nb.Cluster.compare],
    "advise": [axon_nb.advise, axon_nb.Cluster.advise],
}
OPTIONAL_THERE = {("advise", "batch_size")}
"""Required for a run, optional for the advisor (4 samples per rank)."""


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
