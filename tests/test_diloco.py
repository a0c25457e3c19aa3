"""``DiLoCo``: the outer loop equals DDP in its degenerate case (one inner step, outer SGD with
learning rate 1 and no momentum, inner SGD) and LocalSGD with an outer learning rate of 1; its
model all-reduce is DDP's gradient all-reduce divided by ``inner_steps`` (halved again in
bf16, counted in bytes); bad options are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from equivalence import check_equal
from models import make_mlp
from periodic_averaging import ARGS, model_bytes
from resumed_runs import continued_both_ways

import axon_nb
from axon_nb import DDP, DiLoCo, LocalSGD

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PLAIN = dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False)
"""The outer SGD that only averages."""


def test_one_inner_step_with_a_plain_outer_sgd_is_ddp(pooled_cluster_2: axon_nb.Cluster) -> None:
    reference = axon_nb.train_local(**ARGS)
    check_equal(pooled_cluster_2, reference, {**ARGS, "strategy": DiLoCo(inner_steps=1, **PLAIN)},
                loss_tol=1e-5, param_tol=1e-5)  # fmt: skip


def test_an_outer_learning_rate_of_one_is_local_sgd(pooled_cluster_2: axon_nb.Cluster) -> None:
    adamw = {**ARGS, "optimizer": ("adamw", {"lr": 1e-2})}  # (any inner optimizer)
    local = pooled_cluster_2.train(**adamw, strategy=LocalSGD(period=4))
    diloco = pooled_cluster_2.train(**adamw, strategy=DiLoCo(inner_steps=4, **PLAIN))
    assert diloco.losses == pytest.approx(local.losses, abs=1e-5)
    momentum = pooled_cluster_2.train(**adamw, strategy=DiLoCo(inner_steps=4))
    assert momentum.losses[0] == pytest.approx(local.losses[0], abs=1e-6)  # (no outer step yet)
    assert abs(momentum.losses[-1] - local.losses[-1]) > 1e-4  # (the outer SGD acts)


def test_the_model_travels_inner_steps_times_less_often(pooled_cluster_2: axon_nb.Cluster) -> None:
    params = sum(p.numel() for p in make_mlp().parameters())
    ddp = model_bytes(pooled_cluster_2.train(**ARGS, strategy=DDP()))
    assert ddp == 4 * params * ARGS["steps"]  # every step, every gradient
    for compress, per_value in ((None, 4), ("bf16", 2)):
        run = pooled_cluster_2.train(**ARGS, strategy=DiLoCo(inner_steps=4, compress=compress))
        assert model_bytes(run) == ddp // 4 * per_value // 4  # outer steps after steps 1, 5, 9
    int8 = pooled_cluster_2.train(**ARGS, strategy=DiLoCo(inner_steps=4, compress="int8"))
    assert model_bytes(int8) == 0 and model_bytes(int8, "all_gather") == 3 * (params + 4)
    reference = pooled_cluster_2.train(**ARGS, strategy=DiLoCo(inner_steps=4))
    assert int8.losses == pytest.approx(reference.losses, rel=0.02)  # (quantized, close)


def test_diloco_options_are_checked() -> None:
    refused = [
        (dict(inner_steps=0), "inner_steps must be an integer >= 1"),
        (dict(outer_lr=0), "outer_lr must be a number > 0"),
        (dict(outer_momentum=1.0), "outer_momentum must be in \\[0, 1\\)"),
        (dict(compress="fp8"), "compress must be None, 'bf16' or 'int8'"),
        (dict(shard_size=0), "shard_size must be an integer >= 1"),
    ]
    for bad, said in refused:
        with pytest.raises(ValueError, match=said):
            DiLoCo(**bad)
    assert axon_nb.strategies.resolve_strategy("diloco") == DiLoCo()


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_checkpoint_keeps_the_outer_loop(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, kind: str
) -> None:
    """An outer step (with momentum) falls in each continuation: after a load it must come at
    the same step, from the same global parameters and momentum."""
    args = {**ARGS, "schedule": "cosine", "strategy": DiLoCo(inner_steps=4)}
    uninterrupted, resumed = continued_both_ways(pooled_cluster_2, args, tmp_path / "c", kind)
    assert resumed.losses == uninterrupted.losses  # bit for bit


def test_a_worker_may_be_a_group_of_ranks_sharded_with_fsdp(
    pooled_cluster_4: axon_nb.Cluster, tmp_path: Path
) -> None:
    """Two workers of two FSDP ranks each: the degenerate case is DDP, and a checkpoint keeps
    each rank's shards of the outer loop (sharded and full)."""
    reference = axon_nb.train_local(**ARGS)
    sharded_plain = DiLoCo(inner_steps=1, shard_size=2, **PLAIN)
    check_equal(pooled_cluster_4, reference, {**ARGS, "strategy": sharded_plain},
                loss_tol=1e-5, param_tol=1e-5)  # fmt: skip
    for kind in ("sharded", "full"):
        args = {**ARGS, "strategy": DiLoCo(inner_steps=4, shard_size=2)}
        uninterrupted, resumed = continued_both_ways(pooled_cluster_4, args, tmp_path / kind, kind)
        assert resumed.losses == uninterrupted.losses  # bit for bit
    with pytest.raises(ValueError, match="needs a number of ranks it divides"):
        pooled_cluster_4.train(**ARGS, strategy=DiLoCo(shard_size=3))
