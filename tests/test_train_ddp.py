"""DDP on N ranks equals one process training on the same global batch (gloo, N = 2 and 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP

if TYPE_CHECKING:
    from pool import ClusterPool

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

STEPS = 25
AGREEMENT_BYTES = 4 * 4
"""The loop's one small all-reduce per step: loss, stop, checkpoint written, checkpoint due."""
EXACT = 1e-5
"""fp32 DDP differs from one process only by the order of floating-point sums."""
LOSSY = dict(loss=1e-3, param=1e-2)
"""bf16/fp16 gradients (compression hooks, autocast): AdamW at lr 3e-3 turns rounding of a
gradient into parameter moves of up to about lr; measured ~3e-4 (loss), ~7e-3 (params)."""


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def pooled_cluster_2_and_4(
    request: pytest.FixtureRequest, cluster_pool: ClusterPool
) -> axon_nb.Cluster:
    """The pooled 2-rank cluster, then the 4-rank one: each test runs on both (world2, world4)."""
    return cluster_pool.get(request.param)


def _args(**changes: Any) -> dict[str, Any]:
    args = dict(
        model=make_mlp,
        data=make_data,
        loss=mse,
        steps=STEPS,
        batch_size=32,
        optimizer=("adamw", {"lr": 3e-3}),
        seed=0,
    )
    return {**args, **changes}


def _ranks_params() -> dict[str, torch.Tensor]:
    from IPython import get_ipython

    trained = get_ipython().user_ns["model"].module  # what a %%axon cell sees as `model`
    return {k: v.detach().clone() for k, v in trained.state_dict().items()}


def _compare(cluster: axon_nb.Cluster, **changes: Any) -> tuple[Any, Any, float, float]:
    """Train on the cluster and in one process; largest loss and parameter differences."""
    result = cluster.train(**_args(**changes))
    ref = axon_nb.train_local(**_args(**{**changes, "strategy": None}))
    assert result.steps == ref.steps == STEPS
    per_rank = cluster.run(_ranks_params)
    for params in per_rank[1:]:  # DDP keeps every replica identical, bit for bit
        assert all(torch.equal(params[k], per_rank[0][k]) for k in params)
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True))
    expected = ref.model.state_dict()
    param_diff = max((per_rank[0][k] - v).abs().max().item() for k, v in expected.items())
    return result, ref, loss_diff, param_diff


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ddp_matches_one_process_with_the_global_batch(
    pooled_cluster_2_and_4: axon_nb.Cluster, grad_accum: int
) -> None:
    result, _, loss_diff, param_diff = _compare(pooled_cluster_2_and_4, grad_accum=grad_accum)
    assert loss_diff < EXACT and param_diff < EXACT
    assert result.losses[-1] < 0.5 * result.losses[0]  # it learned, so the match means something
    grads = result.ranks[0]["memory"]["param_bytes"]
    # One all-reduce of every gradient per step (not per micro-step), plus the loss agreement.
    assert result.ranks[0]["comm_totals"]["all_reduce"]["count"] == 2 * STEPS
    assert result.history[-1]["comm_bytes"] == grads + AGREEMENT_BYTES


@pytest.mark.parametrize("hook", ["bf16", "fp16"])
def test_compression_hooks_match_within_lossy_tolerance(
    pooled_cluster_2_and_4: axon_nb.Cluster, hook: str
) -> None:
    result, _, loss_diff, param_diff = _compare(
        pooled_cluster_2_and_4, strategy=DDP(comm_hook=hook)
    )
    assert loss_diff < LOSSY["loss"] and param_diff < LOSSY["param"]
    assert param_diff > EXACT  # the hook really rounded the gradients
    grads = result.ranks[0]["memory"]["param_bytes"]
    # half the bytes on the wire
    assert result.history[-1]["comm_bytes"] == grads // 2 + AGREEMENT_BYTES


def test_powersgd_trains_close_to_the_reference(pooled_cluster_2_and_4: axon_nb.Cluster) -> None:
    strategy = DDP(comm_hook="powersgd", powersgd_rank=2, powersgd_start_step=10)
    result, ref, _, _ = _compare(pooled_cluster_2_and_4, strategy=strategy)
    # Rank-2 approximations of the gradients: same trend, final loss within 10% (measured 4%).
    assert abs(result.losses[-1] - ref.losses[-1]) < 0.1 * ref.losses[-1]
    assert result.losses[:9] == pytest.approx(ref.losses[:9], abs=EXACT)  # plain until step 10
    grads = result.ranks[0]["memory"]["param_bytes"]
    assert result.history[-1]["comm_bytes"] < grads // 2  # low-rank factors, not gradients


@pytest.mark.parametrize(
    "changes",
    [dict(mixed_precision="bf16"), dict(mixed_precision="fp16", clip_grad_norm=0.5, grad_accum=2)],
    ids=["bf16-autocast", "fp16-scaler-clip-accum"],
)
def test_mixed_precision_matches_one_process(
    pooled_cluster_2_and_4: axon_nb.Cluster, changes: dict
) -> None:
    result, ref, loss_diff, param_diff = _compare(pooled_cluster_2_and_4, **changes)
    assert loss_diff < LOSSY["loss"] and param_diff < LOSSY["param"]
    if "clip_grad_norm" in changes:
        norms = [h["grad_norm"] for h in result.history]
        ref_norms = [h["grad_norm"] for h in ref.history]
        assert norms == pytest.approx(ref_norms, rel=1e-2)


def test_schedule_and_warmup_follow_the_reference(pooled_cluster_2_and_4: axon_nb.Cluster) -> None:
    changes = dict(schedule="cosine", warmup_steps=5, clip_grad_norm=1.0)
    result, ref, loss_diff, param_diff = _compare(pooled_cluster_2_and_4, **changes)
    assert loss_diff < EXACT and param_diff < EXACT
    lrs = [h["lr"] for h in result.history]
    assert lrs == [h["lr"] for h in ref.history]
    assert lrs[:5] == pytest.approx([3e-3 * (i + 1) / 5 for i in range(5)])
    assert lrs[-1] < 0.01 * 3e-3


@pytest.mark.parametrize(
    "strategy",
    [DDP(bucket_cap_mb=0.002, find_unused_parameters=True), DDP(static_graph=True)],
    ids=["small-buckets-unused", "static-graph"],
)
def test_ddp_options_reach_ddp_and_keep_the_result(
    pooled_cluster_2_and_4: axon_nb.Cluster, strategy: DDP
) -> None:
    result, _, loss_diff, param_diff = _compare(pooled_cluster_2_and_4, strategy=strategy)
    assert loss_diff < EXACT and param_diff < EXACT
    count = result.ranks[0]["comm_totals"]["all_reduce"]["count"] / STEPS
    # One all-reduce per gradient bucket plus the loss agreement: 2 KB buckets split the 5.9 KB
    # of gradients, the default 25 MB bucket holds them all.
    assert count > 2 if strategy.bucket_cap_mb < 1 else count == 2
