"""User-facing strategies: typed configs, each mapping to a ``ParallelDims`` and a
``ParallelConfig`` (pure Python: built and checked in the kernel, applied on the ranks)."""

from __future__ import annotations

from typing import Any

from axon_nb.strategies.async_sgd import AsyncSGD
from axon_nb.strategies.base import SingleDevice, Strategy
from axon_nb.strategies.ddp import DDP
from axon_nb.strategies.diloco import DiLoCo
from axon_nb.strategies.expert import ExpertParallel
from axon_nb.strategies.fsdp import FSDP
from axon_nb.strategies.hybrid import Hybrid
from axon_nb.strategies.local_sgd import LocalSGD
from axon_nb.strategies.pipeline import Pipeline
from axon_nb.strategies.tensor import TensorParallel
from axon_nb.strategies.zero import ZeRO

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDP,
    "expert": ExpertParallel,
    "fsdp": FSDP,
    "zero": ZeRO,
    "pipeline": Pipeline,
    "tensor": TensorParallel,
    "hybrid": Hybrid,
    "local_sgd": LocalSGD,
    "diloco": DiLoCo,
    "async_sgd": AsyncSGD,
    "single_device": SingleDevice,
}
"""Strategies by name, for ``strategy="ddp"``."""

__all__ = [
    "DDP",
    "FSDP",
    "STRATEGIES",
    "AsyncSGD",
    "DiLoCo",
    "ExpertParallel",
    "Hybrid",
    "LocalSGD",
    "Pipeline",
    "SingleDevice",
    "Strategy",
    "TensorParallel",
    "ZeRO",
    "resolve_strategy",
]


def resolve_strategy(value: Any, default: type[Strategy] = DDP) -> Strategy:
    """A :class:`Strategy` from an instance, a registered name, or None (``default()``)."""
    if value is None:
        return default()
    if isinstance(value, Strategy):
        return value
    if isinstance(value, str) and value.lower() in STRATEGIES:
        return STRATEGIES[value.lower()]()
    if isinstance(value, type) and issubclass(value, Strategy):
        return value()
    raise ValueError(
        f"unknown strategy {value!r}: use one of {', '.join(sorted(STRATEGIES))} "
        "(or an instance such as DDP(comm_hook='bf16'))"
    )
