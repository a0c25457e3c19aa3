"""The NCCL / CUDA paths: run where a GPU is present (skipped elsewhere, e.g. in CI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP, FSDP, ZeRO
from axon_nb.models import GPT, GPTConfig, token_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARGS = dict(model=make_mlp, data=make_data, loss=mse, batch_size=32, steps=25, seed=0)
GPT_ARGS: dict[str, Any] = dict(
    model=lambda: GPT(GPTConfig()),
    data=token_dataset,
    batch_size=32,
    steps=10,
    optimizer=("adamw", {"lr": 1e-3}),
)


@pytest.fixture(scope="module")
def own_cluster_1() -> Iterator[axon_nb.Cluster]:
    """One rank of this module's own, stopped after it."""
    with axon_nb.Cluster(n=1, timeout=120) as c:  # backend "auto" must pick nccl
        yield c


def _rank_params() -> dict[str, torch.Tensor]:
    from axon_nb.rank.training import trainstate

    return {k: v.detach().cpu() for k, v in trainstate.get("model").module.state_dict().items()}


def test_auto_binds_the_gpu_and_picks_nccl(own_cluster_1: axon_nb.Cluster) -> None:
    assert own_cluster_1.ranks[0]["backend"] == "nccl"
    assert own_cluster_1.ranks[0]["device"] == "cuda:0"


@pytest.mark.parametrize("hook", [None, "bf16"])
def test_ddp_on_nccl_matches_one_process_on_the_gpu(
    own_cluster_1: axon_nb.Cluster, hook: str
) -> None:
    result = own_cluster_1.train(**ARGS, strategy=DDP(comm_hook=hook))
    ref = axon_nb.train_local(**ARGS, device="cuda")
    tolerance = 1e-5 if hook is None else 1e-2
    assert result.losses == pytest.approx(ref.losses, abs=tolerance)
    params = own_cluster_1.run(_rank_params)[0]
    for k, v in ref.model.state_dict().items():
        assert torch.allclose(params[k], v.cpu(), atol=tolerance), k
    memory = result.ranks[0]["memory"]
    assert memory["cuda_peak"] >= memory["cuda_allocated"] > 0
    assert result.ranks[0]["comm_totals"]["all_reduce"]["count"] >= ARGS["steps"]


def test_status_reports_gpu_memory(own_cluster_1: axon_nb.Cluster) -> None:
    from axon_nb.rank.observe.rank_status import rank_status
    from axon_nb.widgets.status import status_text

    rows = own_cluster_1.run(rank_status, stream=False)
    assert rows[0]["cuda_total"] > rows[0]["cuda_free"] > 0
    assert "GPU" in status_text(rows)


@pytest.mark.parametrize(
    "strategy",
    [FSDP(), FSDP(cpu_offload=True), ZeRO(stage=1), ZeRO(stage=2)],
    ids=["fsdp", "fsdp-cpu-offload", "zero1", "zero2"],
)
def test_sharded_strategies_run_on_nccl(own_cluster_1: axon_nb.Cluster, strategy: Any) -> None:
    result = own_cluster_1.train(**GPT_ARGS, strategy=strategy)
    ref = axon_nb.train_local(**GPT_ARGS, device="cuda")
    assert result.losses == pytest.approx(ref.losses, abs=1e-4)
    assert result.memory[0]["peak_bytes"] == result.memory[0]["cuda_peak"] > 0


def test_checkpoint_round_trip_on_nccl(own_cluster_1: axon_nb.Cluster, tmp_path: Path) -> None:
    args = {**GPT_ARGS, "strategy": FSDP()}
    own_cluster_1.train(**{**args, "steps": 4}, name="a")
    own_cluster_1.save(tmp_path / "ckpt", "sharded", name="a")
    uninterrupted = own_cluster_1.train(**{**args, "steps": 3}, name="a", resume=True)
    own_cluster_1.train(**{**args, "steps": 0}, name="b")
    own_cluster_1.load(tmp_path / "ckpt", name="b")
    resumed = own_cluster_1.train(**{**args, "steps": 3}, name="b", resume=True)
    assert resumed.losses == uninterrupted.losses


def _sync_warnings(steps: int) -> int:
    """Host syncs CUDA reports while ``train_local`` runs ``steps`` steps on the GPU."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            axon_nb.train_local(**{**GPT_ARGS, "steps": steps}, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_steps_do_not_wait_for_the_gpu() -> None:
    # set-up and the end of the run may sync; the steps between them must not
    assert _sync_warnings(steps=8) == _sync_warnings(steps=3)


def test_compiled_bf16_run_with_prefetch_matches_one_process(
    own_cluster_1: axon_nb.Cluster,
) -> None:
    args = {**GPT_ARGS, "mixed_precision": "bf16"}
    result = own_cluster_1.train(**args, strategy=FSDP(), compile=True)
    ref = axon_nb.train_local(**args, device="cuda")
    assert result.losses == pytest.approx(ref.losses, abs=2e-2)  # bf16 rounding
    fused = own_cluster_1.run(lambda: _first_group()["fused"], stream=False)
    assert fused == [True]  # AdamW on CUDA is the fused kernel


def _first_group() -> dict[str, Any]:
    from axon_nb.rank.training import trainstate

    return trainstate.get("model").optimizer.param_groups[0]


def test_status_and_memory_carry_nvml_figures(own_cluster_1: axon_nb.Cluster) -> None:
    pytest.importorskip("pynvml")
    from axon_nb.rank.observe.rank_status import rank_status

    row = own_cluster_1.run(rank_status, stream=False)[0]
    assert 0 <= row["gpu_util"] <= 100 and 0 <= row["memory_bw_util"] <= 100
    result = own_cluster_1.train(**GPT_ARGS)
    assert "gpu_util" in result.ranks[0]["memory"]


def test_prefetched_batches_arrive_whole_and_in_order_on_the_gpu() -> None:
    from axon_nb.rank.data.prefetch import prefetched

    steps = [[(torch.full((256, 256), float(i)).pin_memory(), torch.tensor([i]))] for i in range(5)]
    got = list(prefetched(iter(steps), torch.device("cuda", 0)))
    assert [int(b[0][1].item()) for b in got] == [0, 1, 2, 3, 4]
    assert all(b[0][0].is_cuda and bool((b[0][0] == i).all()) for i, b in enumerate(got))
