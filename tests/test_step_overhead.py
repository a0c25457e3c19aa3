"""The loop adds no lockstep of its own to a step: on CPU ranks (gloo) the per-step agreement
is left running and read a step later, so a rank late into it does not hold the others."""

from __future__ import annotations

import functools
import uuid
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import make_data, make_mlp, mse

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

LATE_STEP = 5
"""The step at which rank 1 is late into the agreement (after the steps the peak tracker
watches)."""
WAIT_S = 20.0
"""How long rank 1 waits for rank 0 to start its next step: with a loop that waited for every
rank in the agreement, rank 0 never would (it waits for rank 1), and rank 1 gives up."""
_STATE: dict[str, Any] = {}
"""This rank's view of the run (a module of its own on each engine)."""


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


class LateAdamW(torch.optim.AdamW):
    """AdamW whose step ``late_step`` on rank 1 first waits for rank 0 to start the next step,
    as a rank slowed down after its gradients were all-reduced would."""

    def __init__(self, params: Any, *, token: str, late_step: int) -> None:
        super().__init__(params, lr=3e-3)
        self.token, self.late_step = token, late_step
        _STATE.clear()
        _STATE["steps"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        _STATE["steps"] += 1
        if dist.get_rank() == 1 and _STATE["steps"] == self.late_step:
            try:
                _store().wait([self.token], timedelta(seconds=WAIT_S))
                _STATE["saw_next_step"] = True
            except RuntimeError:  # timed out: rank 0 was held in this step's agreement
                _STATE["saw_next_step"] = False
        return super().step(closure)


def signalling_mse(output: torch.Tensor, target: torch.Tensor, *, token: str) -> torch.Tensor:
    """``mse``; on rank 0, the first call after ``LATE_STEP`` optimizer steps (the next step's
    forward) tells rank 1 that rank 0 started it."""
    if dist.get_rank() == 0 and _STATE["steps"] >= LATE_STEP and "signalled" not in _STATE:
        _store().set(token, "1")
        _STATE["signalled"] = True
    return mse(output, target)


def _state() -> dict[str, Any]:
    return dict(_STATE)


def test_a_rank_late_into_the_agreement_does_not_hold_the_others(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    token = f"test_step_overhead/{uuid.uuid4().hex}"
    result = pooled_cluster_2.train(
        model=make_mlp,
        data=make_data,
        loss=functools.partial(signalling_mse, token=token),
        optimizer=functools.partial(LateAdamW, token=token, late_step=LATE_STEP),
        steps=LATE_STEP + 3,
        batch_size=32,
        seed=0,
    )
    states = pooled_cluster_2.run(_state)
    assert states[0]["signalled"]  # rank 0 started step LATE_STEP + 1 ...
    assert states[1]["saw_next_step"]  # ... while rank 1 was still in step LATE_STEP
    # Read a step late, the agreement still gives every step its global loss, in order.
    assert [h["step"] for h in result.history] == list(range(1, LATE_STEP + 4))
    for entry in result.history:
        assert entry["loss"] == pytest.approx(sum(entry["per_rank"]["loss"]) / 2)
    grads = result.ranks[0]["memory"]["param_bytes"]
    # Each step's figures count the collectives it started, the agreement's too.
    assert [h["comm_bytes"] for h in result.history] == [grads + 16] * (LATE_STEP + 3)
