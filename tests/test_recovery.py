"""Never lose a training run: periodic checkpoints during train, and automatic restart and
resume after a rank is killed, ending exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch
from equivalence import full_params
from helpers import until

import axon_nb
from axon_nb import DDP, FSDP, AsyncSGD, DiLoCo, Hybrid, Pipeline, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset
from axon_nb.spec.checkpoint_series import checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

_BENCHMARKS = str(Path(__file__).parent.parent / "benchmarks")
sys.path.insert(0, _BENCHMARKS)
from recovery import kill_a_rank_at  # noqa: E402  (shared with benchmarks/recovery.py)

if TYPE_CHECKING:
    from pool import ClusterPool

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=32, vocab_size=64)
ARGS: dict[str, Any] = dict(
    model=lambda: GPT(CONFIG),
    data=token_dataset,
    loss=lm_loss,
    steps=24,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    seed=0,
)


def test_periodic_checkpoints_are_kept_and_resume_exactly(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    whole = pooled_cluster_2.train(**ARGS)
    expected = pooled_cluster_2.run(full_params, stream=False)[0]
    result = pooled_cluster_2.train(**ARGS, checkpoint_dir=tmp_path, checkpoint_every=5, keep=2)
    assert result.losses == whole.losses  # writing in the background changes nothing
    kept = checkpoints(str(tmp_path))
    assert [os.path.basename(p) for p in kept] == ["step-00000015", "step-00000020"]
    assert result.checkpoint == {"step": 20, "path": kept[-1]}
    assert not list(tmp_path.glob("*.partial-*"))
    # the newest one resumes to the same end as never stopping
    pooled_cluster_2.train(**{**ARGS, "steps": 0}, strategy=DDP())
    pooled_cluster_2.load(kept[-1])
    rest = pooled_cluster_2.train(**{**ARGS, "steps": 4}, resume=True)
    assert rest.losses == whole.losses[-4:]
    resumed = pooled_cluster_2.run(full_params, stream=False)[0]
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def _paced_lm_loss(slower_from: int):
    """lm_loss, the same figures, but a step takes at least 25 ms, and 100 ms from the
    ``slower_from``-th call on: the killer sees the steps through the stream, and under load
    it saw its step too late (the run ended first, a miss). A 2-rank run of this model takes
    about 0.5 s for its 24 steps unpaced."""
    calls = {"n": 0}

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        time.sleep(0.1 if calls["n"] >= slower_from else 0.025)
        return lm_loss(output, target)

    return loss


LAYOUTS = [
    (DDP(), 2),
    (FSDP(), 2),
    (ZeRO(stage=2), 2),
    (Pipeline(), 2),
    (Hybrid(dp=2, pp=2), 4),
]


@pytest.mark.parametrize(("strategy", "ranks"), LAYOUTS, ids=lambda v: repr(v))
def test_a_killed_rank_is_recovered_and_the_run_ends_as_if_never_killed(
    strategy: Any, ranks: int, tmp_path: Path, cluster_pool: ClusterPool
) -> None:
    rng = random.Random(f"{strategy!r}")
    kill_step, victim = rng.randint(9, 18), rng.randrange(ranks)
    args = {**ARGS, "strategy": strategy}
    cluster = cluster_pool.get(ranks)  # recovered, it goes back to the pool as good as new
    whole = cluster.train(**args)
    expected = cluster.run(full_params, stream=False)[0]
    killer = kill_a_rank_at(cluster, kill_step, victim)
    result = cluster.train(
        **{**args, "loss": _paced_lm_loss(kill_step)},
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
        keep=2,
        max_restarts=2,
        metrics_interval_s=0.05,  # the killer sees the steps soon enough to land mid-run
    )
    assert "missed" not in killer, f"the run ended before step {kill_step} was seen"
    assert len(result.restarts) == 1, result.restarts
    restart = result.restarts[0]
    failed, resumed = restart["failed_at_step"], restart["resumed_from"]
    assert failed >= kill_step
    # from a periodic checkpoint (every 4 steps), the newest or (still being written) the one
    # before it
    assert resumed % 4 == 0 and 4 <= resumed <= failed and failed - resumed < 8
    assert [h["step"] for h in result.history] == list(range(1, ARGS["steps"] + 1))
    assert result.losses == whole.losses  # bit for bit
    recovered = cluster.run(full_params, stream=False)[0]
    assert all(torch.equal(recovered[k], expected[k]) for k in expected)


def test_a_kill_that_missed_its_run_never_lands_in_a_later_one(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """The killer above watches the next ``train`` call only: once (under load) a kill meant
    for one test's run landed in the next test's run and broke the cluster for every test
    after it."""
    pids = [r["pid"] for r in pooled_cluster_2.ranks]
    killer = kill_a_rank_at(pooled_cluster_2, 3, 1)
    pooled_cluster_2.train(**{**ARGS, "steps": 2})  # ends before step 3
    until(lambda: "missed" in killer, 30)
    assert "missed" in killer
    pooled_cluster_2.train(**{**ARGS, "steps": 6})  # reaches step 3: nothing is killed
    assert [r["pid"] for r in pooled_cluster_2.ranks] == pids
    assert all(psutil.pid_exists(pid) for pid in pids)


def test_bad_checkpoint_options_are_refused(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="need checkpoint_dir="):
        pooled_cluster_2.train(**ARGS, checkpoint_every=5)
    with pytest.raises(ValueError, match=r"max_restarts .* need checkpoint_dir="):
        pooled_cluster_2.train(**ARGS, max_restarts=1)
    with pytest.raises(ValueError, match="needs checkpoint_every="):
        pooled_cluster_2.train(**ARGS, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        pooled_cluster_2.train(**ARGS, checkpoint_dir=tmp_path, checkpoint_every=2, keep=0)
    with pytest.raises(ValueError, match="max_restarts needs block=True"):
        pooled_cluster_2.train(
            **ARGS, checkpoint_dir=tmp_path, checkpoint_every=2, max_restarts=1, block=False
        )


def _rank_3_of_4_dies_at_its_7th_step(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """lm_loss, but rank 3 of a 4-rank world is SIGKILLed at its 7th step of every run: a
    rank that cannot come back."""
    import signal

    import torch.distributed as dist

    calls = int(os.environ.get("AXON_TEST_LOSS_CALLS", "0")) + 1
    os.environ["AXON_TEST_LOSS_CALLS"] = str(calls)  # (fresh engines start from 0)
    if dist.get_world_size() == 4 and dist.get_rank() == 3 and calls == 7:
        # What the ranks streamed reaches the kernel before the death does (the peers wait in
        # this step's collective meanwhile): flushing waits for this engine's IOPub queue.
        sys.stdout.flush()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return lm_loss(output, target)


@pytest.mark.parametrize(
    "strategy", [DDP(), AsyncSGD(staleness=2), DiLoCo(inner_steps=4)], ids=lambda s: s.name
)
def test_a_rank_that_cannot_come_back_is_left_out(tmp_path: Path, strategy: Any) -> None:
    """Also for AsyncSGD and DiLoCo, whose runs go on with fewer ranks too (their state in
    checkpoints loading on another number of ranks: ``test_async_sgd.py``)."""
    args = {**ARGS, "steps": 16, "strategy": strategy}
    with axon_nb.Cluster(n=4, timeout=60) as cluster:
        whole = cluster.train(**args)
        with pytest.raises(ValueError, match="min_ranks=5 is more than the 4 ranks"):
            cluster.train(**args, checkpoint_dir=tmp_path, checkpoint_every=4, max_restarts=1,
                          min_ranks=5)  # fmt: skip
        result = cluster.train(
            **{**args, "loss": _rank_3_of_4_dies_at_its_7th_step},
            checkpoint_dir=tmp_path,
            checkpoint_every=4,
            max_restarts=3,
            min_ranks=2,
            # every step's record streams (a step can take less than any interval: the
            # restarted run's steps took 24 ms under a 50 ms one, and streamed up to step 4)
            metrics_interval_s=1e-6,
        )
        # rank 3 died at its 7th step, and again after a restart on 4 ranks; 3 ranks
        # cannot split batch_size=16, so the run went on with 2
        assert [(r["rank"], r["world_size"]) for r in result.restarts] == [(3, 4), (3, 2)]
        # the last step streamed: a step's record is complete once the next step's agreement
        # is posted (the loop reads it a step late; AsyncSGD's, staleness steps late), so step
        # 5's (AsyncSGD: 4's) while rank 3 was in step 7
        lag = strategy.staleness if isinstance(strategy, AsyncSGD) else 1
        assert all(r["failed_at_step"] >= 6 - lag for r in result.restarts)
        assert len(cluster.ranks) == 2
        assert [h["step"] for h in result.history] == list(range(1, 17))
        # the same samples per step; only the order of the smaller world's sums differs
        if not isinstance(strategy, DiLoCo):
            assert result.losses == pytest.approx(whole.losses, rel=1e-4)
        else:  # (its workers step on their own data: fewer workers train otherwise) it is
            # the run of the smaller world from where it resumed, here the start
            assert [r["resumed_from"] for r in result.restarts] == [0, 0]
            smaller = cluster.train(**args)
            assert result.losses == pytest.approx(smaller.losses, rel=1e-4)
