"""The ZeRO paper's per-rank model-state formulas (Table 1), as ``estimate.memory`` gives them."""

from __future__ import annotations

import pytest

from axon_nb import DDP, FSDP, ZeRO, estimate

PSI, N = 1_000_000, 4


@pytest.mark.parametrize(
    ("strategy", "mixed", "total"),
    [
        (DDP(), True, 16 * PSI),
        (ZeRO(stage=1), True, 4 * PSI + 12 * PSI / N),
        ("zero", False, 8 * PSI + 8 * PSI / N),
        (ZeRO(stage=3), True, 16 * PSI / N),
        (FSDP(), False, 16 * PSI / N),
        (FSDP(sharding="no_shard"), False, 16 * PSI),
        (FSDP(sharding="hybrid_shard", shard_size=2), False, 16 * PSI / 2),
    ],
)
def test_formulas(strategy: object, mixed: bool, total: float) -> None:
    figures = estimate.memory(PSI, strategy, N, mixed_precision=mixed)
    assert figures["total"] == pytest.approx(total)
    assert figures["total"] == pytest.approx(
        figures["params"] + figures["grads"] + figures["optimizer"]
    )


def test_sharding_orders_the_strategies() -> None:
    totals = [estimate.memory(PSI, s, N)["total"] for s in (DDP(), ZeRO(stage=1), ZeRO(stage=3))]
    assert totals == sorted(totals, reverse=True)


def test_unknown_strategy_and_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="no memory formula"):
        estimate.memory(PSI, "pipeline", N)
    with pytest.raises(TypeError, match="model or a parameter count"):
        estimate.memory("big", DDP(), N)
