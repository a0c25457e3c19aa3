"""``LocalSGD``: post-local SGD equals DDP when it averages every step (plain SGD), and
all-reduces ``period`` times less often (counted in bytes)."""

from __future__ import annotations

import pytest
from equivalence import check_equal
from models import make_mlp
from periodic_averaging import ARGS, model_bytes

import axon_nb
from axon_nb import DDP, LocalSGD

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_averaging_every_step_is_ddp(pooled_cluster_2: axon_nb.Cluster) -> None:
    ref = axon_nb.train_local(**ARGS)
    check_equal(pooled_cluster_2, ref, {**ARGS, "strategy": LocalSGD(period=1)}, loss_tol=1e-5,
                param_tol=1e-5)  # fmt: skip


def test_period_k_all_reduces_k_times_less(pooled_cluster_2: axon_nb.Cluster) -> None:
    params = sum(p.numel() for p in make_mlp().parameters())
    ddp = model_bytes(pooled_cluster_2.train(**ARGS, strategy=DDP()))
    local = model_bytes(pooled_cluster_2.train(**ARGS, strategy=LocalSGD(period=4)))
    assert ddp == 4 * params * ARGS["steps"]  # every step, every gradient
    assert local == 4 * params * ARGS["steps"] // 4  # every 4th step, every parameter
    warm = pooled_cluster_2.train(**ARGS, strategy=LocalSGD(period=4, warmup_steps=4))
    ddp_run = pooled_cluster_2.train(**ARGS, strategy=DDP())
    assert warm.losses[:5] == pytest.approx(ddp_run.losses[:5], abs=1e-6)  # DDP while warm


def test_local_sgd_options_are_checked() -> None:
    with pytest.raises(ValueError, match="period must be an integer >= 1"):
        LocalSGD(period=0)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        LocalSGD(warmup_steps=-1)
    assert axon_nb.strategies.resolve_strategy("local_sgd") == LocalSGD()
