"""``AsyncSGD``: with no staleness it is DDP for any optimizer; with staleness ``s`` every step
applies the mean gradient of ``s`` steps ago, the same on every rank, as a one-process
delayed-gradient optimizer does on the whole batch; bad options are refused."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import check_equal
from models import make_data, make_mlp, mse
from periodic_averaging import ARGS, model_bytes
from resumed_runs import continued_both_ways

import axon_nb
from axon_nb import DDP, AsyncSGD, estimate

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

STATEFUL = {**ARGS, "optimizer": ("sgd", {"lr": 0.1, "momentum": 0.9}), "schedule": "cosine"}
"""A run whose inner optimizer has state (momentum) and whose learning rate changes every
step: a checkpoint must bring back both, besides the gradients in flight."""


class DelayedGradients(torch.optim.Optimizer):
    """The reference, in one process: ``inner`` steps on the gradients of ``staleness``
    steps ago (none for the first ``staleness`` steps)."""

    def __init__(self, inner: torch.optim.Optimizer, staleness: int) -> None:
        self.inner, self.staleness = inner, staleness
        self.param_groups, self.state, self.defaults = (
            inner.param_groups,
            inner.state,
            inner.defaults,
        )
        self.sent: deque[list[torch.Tensor]] = deque()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self.sent.append([p.grad.detach().clone() for p in params])
        if len(self.sent) > self.staleness:
            for p, old in zip(params, self.sent.popleft(), strict=True):
                p.grad = old
            self.inner.step()


def test_no_staleness_is_ddp_for_any_optimizer(pooled_cluster_2: axon_nb.Cluster) -> None:
    adamw = {**ARGS, "optimizer": ("adamw", {"lr": 1e-2})}
    reference = axon_nb.train_local(**adamw)
    check_equal(pooled_cluster_2, reference, {**adamw, "strategy": AsyncSGD(staleness=0)},
                loss_tol=1e-5, param_tol=1e-5)  # fmt: skip


@pytest.mark.parametrize("staleness", [1, 3])
def test_each_step_applies_the_mean_gradient_of_staleness_steps_ago(
    pooled_cluster_2: axon_nb.Cluster, staleness: int
) -> None:
    def delayed(params: Any) -> torch.optim.Optimizer:
        return DelayedGradients(torch.optim.SGD(params, lr=0.1, momentum=0.9), staleness)

    reference = axon_nb.train_local(**{**ARGS, "optimizer": delayed})
    run = {**ARGS, "optimizer": ("sgd", {"lr": 0.1, "momentum": 0.9})}
    strategy = AsyncSGD(staleness=staleness)
    result = check_equal(pooled_cluster_2, reference, {**run, "strategy": strategy},
                         loss_tol=1e-5, param_tol=1e-5)  # fmt: skip
    ddp = pooled_cluster_2.train(**run, strategy="ddp")
    assert abs(ddp.losses[-1] - result.losses[-1]) > 1e-4  # (the staleness shows)


def test_asyncsgd_options_are_checked(pooled_cluster_2: axon_nb.Cluster) -> None:
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
            AsyncSGD(staleness=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'fp16' cannot be used with AsyncSGD"):
        pooled_cluster_2.train(**ARGS, strategy=AsyncSGD(staleness=1), mixed_precision="fp16")
    assert axon_nb.strategies.resolve_strategy("async_sgd") == AsyncSGD()


def test_its_bytes_are_ddps_and_the_estimate_says_so(pooled_cluster_2: axon_nb.Cluster) -> None:
    params = sum(p.numel() for p in make_mlp().parameters())
    run = pooled_cluster_2.train(**ARGS, strategy=AsyncSGD(staleness=2))
    assert model_bytes(run) == 4 * params * ARGS["steps"]
    profile = estimate.profile(make_mlp, make_data, mse)
    sizes = dict(world_size=2, batch_size=ARGS["batch_size"], optimizer="sgd")
    predicted = estimate.predict(profile, AsyncSGD(staleness=2), **sizes)
    assert [r["comm"] for r in predicted.ranks] == [
        r["comm"] for r in estimate.predict(profile, DDP(), **sizes).ranks
    ]
    assert predicted.ranks[0]["comm"]["all_reduce"] == pytest.approx(4 * params + 16)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_checkpoint_keeps_the_gradients_in_flight(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, kind: str
) -> None:
    args = {**STATEFUL, "strategy": AsyncSGD(staleness=2)}
    uninterrupted, resumed = continued_both_ways(pooled_cluster_2, args, tmp_path / "c", kind)
    assert resumed.losses == uninterrupted.losses  # bit for bit (no second warm-up)


def test_a_checkpoint_continues_on_another_number_of_ranks(
    pooled_cluster_2: axon_nb.Cluster, pooled_cluster_4: axon_nb.Cluster, tmp_path: Path
) -> None:
    """As after a rank's death with ``min_ranks``, or a resize: the mean gradients in flight
    are the same on every rank, so they load on any number."""
    args = {**ARGS, "strategy": AsyncSGD(staleness=2)}
    uninterrupted, resumed = continued_both_ways(
        pooled_cluster_2, args, tmp_path / "c", "sharded", target=pooled_cluster_4
    )
    assert resumed.losses == pytest.approx(uninterrupted.losses, abs=1e-5)
