"""``predict``: per-rank memory and communication of a strategy, from a ``ModelProfile``.

Example::

    profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
    p = axon_nb.estimate.predict(profile, FSDP(), world_size=4, batch_size=32)
    p.peak_bytes, p.comm_bytes, p.ranks[0]["memory"]["activations"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axon_nb.estimate.comm_model import predict_comm
from axon_nb.estimate.memory_model import predict_memory
from axon_nb.estimate.profile import ModelProfile
from axon_nb.estimate.rank_layout import rank_layouts


@dataclass(frozen=True, slots=True)
class Prediction:
    """What one strategy is predicted to need on each rank."""

    strategy: str
    ranks: list[dict[str, Any]]
    """Per rank: ``memory`` (bytes by term and ``peak``) and ``comm`` (bytes by kind)."""

    @property
    def peak_bytes(self) -> float:
        """The largest rank's peak: the one that runs out of memory first."""
        return max(r["memory"]["peak"] for r in self.ranks)

    @property
    def peak_phase(self) -> str:
        """The phase that holds the largest rank's peak: ``backward``, ``step`` (the
        optimizer's) or ``pipeline`` (a schedule's interleaved forward and backward)."""
        return str(max(self.ranks, key=lambda r: r["memory"]["peak"])["memory"]["phase"])

    @property
    def comm_bytes(self) -> float:
        """The busiest rank's bytes per step."""
        return max(sum(r["comm"].values()) for r in self.ranks)

    def __str__(self) -> str:
        return (
            f"{self.strategy}: peak {self.peak_bytes / 2**20:,.1f} MiB per rank (in "
            f"{self.peak_phase}), "
            f"{self.comm_bytes / 2**20:,.2f} MiB communicated per step"
        )


def predict(
    profile: ModelProfile,
    strategy: Any,
    *,
    world_size: int,
    batch_size: int,
    ranks_per_host: int | None = None,
    grad_accum: int = 1,
    optimizer: Any = "adamw",
    mixed_precision: str | None = None,
    device_type: str | None = None,
) -> Prediction:
    """Predict ``strategy`` on ``world_size`` ranks training ``batch_size`` samples a step
    on devices of ``device_type`` (``cpu`` or ``cuda``: the optimizer's default path; by
    default the profile's).

    ``ValueError`` when the strategy cannot run so (the message says why).
    """
    from axon_nb.strategies import resolve_strategy

    strategy = resolve_strategy(strategy)
    layouts = rank_layouts(
        profile,
        strategy,
        world_size,
        batch_size,
        ranks_per_host=ranks_per_host or world_size,
        grad_accum=grad_accum,
    )
    ranks = [
        {
            "rank": layout.rank,
            "memory": predict_memory(
                profile,
                layout,
                optimizer=optimizer,
                mixed_precision=mixed_precision,
                device_type=device_type or profile.device_type,
            ),
            "comm": predict_comm(profile, layout),
        }
        for layout in layouts
    ]
    return Prediction(strategy.describe(), ranks)
