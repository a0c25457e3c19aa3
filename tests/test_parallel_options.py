"""Options wherever PyTorch supports them: activation checkpointing under every strategy, fp16
with sharded gradients, Hybrid's data-parallel axis as DDP or hybrid-sharded FSDP, ZeRO-3's
FSDP options; and the shape that makes them composable (ParallelDims, configs, one side per
module)."""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import check_equal, full_params

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset
from axon_nb.spec.parallel_dims import ParallelDims

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=32, vocab_size=64)
ARGS: dict[str, Any] = dict(
    model=lambda: GPT(CONFIG),
    data=token_dataset,
    loss=lm_loss,
    steps=12,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    seed=0,
)
EXACT = dict(loss_tol=1e-5, param_tol=5e-4)
"""As in the other strategy tests: summation order only (AdamW magnifies it in parameters)."""
LOSSY = dict(loss_tol=1e-3, param_tol=5e-2)
"""fp16 autocast: rounding of fp16 activations differs with the order of sums; losses agree to
~3e-5, but AdamW at lr 3e-3 turns the rounding of tiny bias gradients into parameter moves of
up to ~lr per step (measured 0.034 after 12 steps, the same for DDP)."""


@pytest.fixture(scope="module")
def reference() -> axon_nb.TrainResult:
    return axon_nb.train_local(**ARGS)


@pytest.fixture(scope="module")
def reference_fp16() -> axon_nb.TrainResult:
    return axon_nb.train_local(**ARGS, mixed_precision="fp16", clip_grad_norm=1.0)


# -- configs: checked at construction, only what they honour ---------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ZeRO(stage=3, comm_hook="bf16"), "comm_hook='bf16' is honoured by stage 1 only"),
        (lambda: ZeRO(stage=2, param_dtype="bf16"), "param_dtype='bf16' is honoured by stage 3"),
        (lambda: ZeRO(stage=1, cpu_offload=True), "cpu_offload=True is honoured by stage 3"),
        (
            lambda: Hybrid(dp=2, data_parallel="ddp", sharding="hybrid_shard"),
            "sharding configure FSDP, but data_parallel='ddp'",
        ),
        (lambda: Hybrid(dp=4, sharding="hybrid_shard"), "needs shard_size="),
        (lambda: Hybrid(dp=2, tp=2, data_parallel="ddp"), "DDP does not take tensor-parallel"),
        (lambda: Hybrid(data_parallel="zero"), "data_parallel must be 'fsdp' or 'ddp'"),
        (lambda: DDP(activation_checkpointing=True, interval=0), "interval must be an integer"),
    ],
)
def test_an_option_a_strategy_cannot_honour_is_refused_with_the_reason(
    build: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(ValueError) as e:
        ZeRO(stage=2, comm_hook="bf16", cpu_offload=True, bucket_cap_mb=0)
    assert str(e.value).count("\n  - ") == 3


def test_a_repr_shows_the_options_that_were_set() -> None:
    assert repr(ZeRO(stage=3)) == "ZeRO(stage=3)"
    assert repr(ZeRO()) == "ZeRO(stage=1)"
    assert repr(FSDP(activation_checkpointing=True)) == "FSDP(activation_checkpointing=True)"
    assert repr(DDP()) == "DDP()"


def test_parallel_dims_is_the_one_layout() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=1, world_size=8)
    assert dims.dp == 4
    assert dims.coords(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "ep": 0, "dp": 2, "tp": 1}
    # tensor-parallel peers read the same data; their loss counts once in the mean
    assert dims.data_rank(4) == dims.data_rank(5) == (2, 4)
    assert sum(dims.loss_share(r) for r in range(8)) == pytest.approx(1.0)
    piped = ParallelDims(dp_shard=2, pp=2, world_size=4)
    assert [piped.loss_share(r) for r in range(4)] == [0.0, 0.0, 0.5, 0.5]
    split = r"= 8, but there are 4 ranks \(dp = dp_replicate=2 x dp_shard=2\)"
    with pytest.raises(ValueError, match=split):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=4)
    with pytest.raises(ValueError, match="positive integers, got tp=0"):
        ParallelDims(tp=0, world_size=1)


def test_strategies_map_to_dims_and_configs() -> None:
    assert FSDP(sharding="hybrid_shard").dims(8, ranks_per_host=4).dp_replicate == 2
    assert FSDP(sharding="no_shard").dims(4).dp_replicate == 4
    assert ZeRO(stage=2).config().data_parallel == "zero2"
    assert ZeRO(stage=3).config().data_parallel == "fsdp"
    hybrid = Hybrid(dp=4, tp=2, sharding="hybrid_shard", shard_size=2)
    assert (hybrid.dims(8).dp_replicate, hybrid.dims(8).dp_shard, hybrid.dims(8).tp) == (2, 2, 2)
    assert Hybrid(dp=2, data_parallel="ddp").config().data_parallel == "ddp"
    assert Pipeline().config().activation_checkpointing == 0
    assert (
        TensorParallel(activation_checkpointing=True, interval=2).config().activation_checkpointing
        == 2
    )


def test_no_module_name_is_on_both_sides() -> None:
    package = pathlib.Path(axon_nb.__file__).parent
    kernel = {p.stem for p in package.glob("*.py")}
    for folder in ("cluster", "train", "checkpoint", "widgets"):
        kernel |= {p.stem for p in (package / folder).glob("*.py")}
    rank = set()
    for folder in ("rank", "parallel", "metrics"):
        rank |= {p.stem for p in (package / folder).glob("*.py")}
    assert (kernel & rank) - {"__init__"} == set()


# -- the same result as one process, wherever an option now applies --------------------------


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [
        DDP(activation_checkpointing=True),
        ZeRO(stage=1, activation_checkpointing=True),
        ZeRO(stage=2, activation_checkpointing=True, interval=2),
        ZeRO(stage=3, cpu_offload=True, reduce_dtype="fp32"),
        TensorParallel(activation_checkpointing=True),
        Pipeline(activation_checkpointing=True),
    ],
    ids=repr,
)
def test_options_on_two_ranks_equal_one_process(
    pooled_cluster_2: axon_nb.Cluster, reference: axon_nb.TrainResult, strategy: Any
) -> None:
    check_equal(pooled_cluster_2, reference, {**ARGS, "strategy": strategy}, **EXACT)


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [
        Hybrid(dp=2, tp=2, sharding="no_shard"),
        Hybrid(dp=2, pp=2, data_parallel="ddp"),
        Hybrid(dp=4, sharding="hybrid_shard", shard_size=2),
        Hybrid(dp=2, tp=2, activation_checkpointing=True),
        Hybrid(dp=2, pp=2, activation_checkpointing=True),
    ],
    ids=repr,
)
def test_hybrid_data_parallel_axis_on_four_ranks_equals_one_process(
    pooled_cluster_4: axon_nb.Cluster, reference: axon_nb.TrainResult, strategy: Any
) -> None:
    check_equal(pooled_cluster_4, reference, {**ARGS, "strategy": strategy}, **EXACT)


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [ZeRO(stage=2), FSDP(), Pipeline()], ids=repr)
def test_fp16_with_sharded_gradients_equals_one_process(
    pooled_cluster_2: axon_nb.Cluster, reference_fp16: axon_nb.TrainResult, strategy: Any
) -> None:
    args = {**ARGS, "strategy": strategy, "mixed_precision": "fp16", "clip_grad_norm": 1.0}
    result = check_equal(pooled_cluster_2, reference_fp16, args, **LOSSY)
    norms = [h["grad_norm"] for h in result.history]
    assert norms == pytest.approx([h["grad_norm"] for h in reference_fp16.history], rel=1e-3)


def _one_rank_overflows() -> tuple[bool, float]:
    """Rank 0's gradient is inf, rank 1's finite: both must skip the step."""
    import torch.distributed as dist

    from axon_nb.parallel.grad_scaler import GradScaler

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu")
    param.grad = torch.full((4,), float("inf") if dist.get_rank() == 0 else 1.0)
    scaler.step(optimizer)
    scaler.update()
    return bool(torch.equal(param.detach(), torch.ones(4))), scaler.get_scale()


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_ranks_agree_to_skip_a_step_when_one_finds_an_inf(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    assert pooled_cluster_2.run(_one_rank_overflows) == [(True, 32768.0), (True, 32768.0)]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_checkpoint_of_wrapped_blocks_loads_into_plain_ones(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    pooled_cluster_2.train(**ARGS, strategy=ZeRO(stage=2, activation_checkpointing=True))
    saved = pooled_cluster_2.run(full_params, stream=False)[0]
    pooled_cluster_2.save(tmp_path / "ckpt", kind="sharded")
    pooled_cluster_2.train(**{**ARGS, "steps": 0}, strategy=DDP())
    pooled_cluster_2.load(tmp_path / "ckpt")
    loaded = pooled_cluster_2.run(full_params, stream=False)[0]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
