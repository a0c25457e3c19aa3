"""Rescue without checkpoints: when a rank dies mid-run, the survivors live on, and what they
hold together is written as an ordinary checkpoint that continues the run exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from equivalence import full_params

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, ZeRO
from axon_nb.errors import RankDiedError, RankError
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=64)
ARGS: dict[str, Any] = dict(
    model=lambda: GPT(CONFIG),
    data=token_dataset,
    loss=lm_loss,
    steps=40,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    seed=0,
    metrics_interval_s=0.05,
)


def _dying_loss(victim: int, after: int) -> Any:
    """``lm_loss``, but rank ``victim`` SIGKILLs itself in its loss call number ``after + 1``
    (mid-run wherever the machine's load puts the kernel's view of it: a kill from the kernel
    once it has seen a step could come after a fast run has ended)."""
    calls = [0]

    def loss(output: Any, target: Any) -> Any:
        import os
        import signal

        import torch.distributed as dist

        calls[0] += 1
        if dist.get_rank() == victim and calls[0] > after:
            os.kill(os.getpid(), signal.SIGKILL)
        return lm_loss(output, target)

    return loss


def _killed_mid_run(cluster: axon_nb.Cluster, strategy: Any, victim: int) -> int:
    """Train until ``victim`` is SIGKILLed in step 7 or later; the engines still alive."""
    pids = [r["pid"] for r in cluster.ranks]
    micro = getattr(strategy, "microbatches", 1) if getattr(strategy, "pp", 1) > 1 else 1
    with pytest.raises(RankDiedError, match=r"cluster\.rescue\(path\)"):
        cluster.train(**{**ARGS, "loss": _dying_loss(victim, 6 * micro)}, strategy=strategy)
    alive = [r for r, pid in enumerate(pids) if psutil.pid_exists(pid)]
    assert alive == [r for r in range(len(pids)) if r != victim]  # MPI left the others alone
    assert cluster.survivors() == (alive, [victim])
    return victim


def test_ddp_survivors_are_rescued_and_the_run_continues_exactly(tmp_path: Path) -> None:
    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        whole = cluster.train(**ARGS, strategy=DDP())
        expected = cluster.run(full_params, stream=False)[0]
        _killed_mid_run(cluster, DDP(), victim=1)
        with pytest.raises(RankError, match=r"no training run named 'nope' on this rank to"):
            cluster.rescue(tmp_path / "nope", name="nope")
        assert not list(tmp_path.iterdir())  # the failed rescue left nothing
        ckpt = cluster.rescue(tmp_path / "rescued")
        assert 6 <= ckpt.step < ARGS["steps"] and ckpt.kind == "full"
        assert ckpt.trainer["optimizer_state"]
        assert oct((tmp_path / "rescued").stat().st_mode & 0o777) == "0o700"
        cluster.restart()
        cluster.train(**{**ARGS, "steps": 0}, strategy=DDP())
        cluster.load(ckpt.path)
        rest = cluster.train(**{**ARGS, "steps": ARGS["steps"] - ckpt.step}, resume=True)
        assert rest.losses == whole.losses[ckpt.step :]  # bit for bit: nothing was lost
        resumed = cluster.run(full_params, stream=False)[0]
        assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_a_replicated_pipeline_stage_is_rescued_from_its_twin(tmp_path: Path) -> None:
    strategy = Hybrid(dp=2, pp=2, data_parallel="ddp")
    with axon_nb.Cluster(n=4, timeout=60) as cluster:
        _killed_mid_run(cluster, strategy, victim=3)
        ckpt = cluster.rescue(tmp_path / "rescued")
        assert ckpt.trainer["optimizer_state"] and ckpt.world_size == 4
        state = torch.load(Path(ckpt.path) / "state.pt", weights_only=True)
        assert set(state["model"]) == set(ckpt.model)
        assert sorted(state["rng"]) == ["0", "1", "2"]


def test_zero_keeps_the_model_and_fsdp_says_what_is_missing(tmp_path: Path) -> None:
    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        _killed_mid_run(cluster, ZeRO(stage=1), victim=0)
        with pytest.warns(UserWarning, match="holds the model only.*ZeRO shards the optimizer"):
            ckpt = cluster.rescue(tmp_path / "zero")
        assert not ckpt.trainer["optimizer_state"]
        cluster.restart()
        _killed_mid_run(cluster, FSDP(), victim=1)
        with pytest.raises(RuntimeError, match=r"rank 1 held the only copy of .*rows 16\.\.31"):
            cluster.rescue(tmp_path / "fsdp")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["zero"]
