"""What the tests of the strategies that average every few steps share (``LocalSGD``,
``DiLoCo``): a small SGD run, and the all-reduce bytes it moved beyond the loop's own."""

from __future__ import annotations

from typing import Any

from models import make_data, make_mlp, mse

import axon_nb

ARGS: dict[str, Any] = dict(
    model=make_mlp, data=make_data, loss=mse, steps=12, batch_size=32,
    optimizer=("sgd", {"lr": 0.1}),
)  # fmt: skip
AGREEMENT_BYTES = 4 * 4
"""The loop's own all-reduce per step (loss and three flags)."""


def model_bytes(result: axon_nb.TrainResult, kind: str = "all_reduce") -> int:
    """``kind`` bytes of rank 0 beyond the loop's own agreement."""
    total = int(result.ranks[0]["comm_totals"].get(kind, {}).get("bytes", 0))
    return total - (AGREEMENT_BYTES * result.steps if kind == "all_reduce" else 0)
