"""Stopping, resuming, the metrics stream and bad input, on a real 2-rank cluster."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from helpers import ctrl_c_when, until
from models import (
    ArrivesSlowly,
    failing_on_rank,
    make_data,
    make_mlp,
    mse,
    mse_failing_at,
    mse_holding_iopub_at,
    slow_mse,
)

import axon_nb
from axon_nb.metrics.stream import SCHEMA

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


ARGS: dict[str, Any] = dict(
    model=make_mlp, data=make_data, loss=mse, batch_size=32, optimizer=("adamw", {"lr": 3e-3})
)
LONG = 1_000_000
"""Steps for runs that are stopped long before they end."""


def _state(name: str = "model") -> dict[str, Any]:
    from axon_nb.rank.training import trainstate

    state = trainstate.get(name)
    params = {k: v.detach().clone() for k, v in state.module.state_dict().items()}
    return {"step": state.step, "params": params, "lr": state.optimizer.param_groups[0]["lr"]}


def _wait_for_steps(handle: axon_nb.TrainHandle, steps: int) -> None:
    deadline = time.monotonic() + 60
    while len(handle.history) < steps:
        assert not handle.done, "the run ended before it could be stopped"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_stop_leaves_ranks_in_step_and_resume_continues_exactly(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    handle = pooled_cluster_2.train(**ARGS, steps=LONG, block=False)
    assert isinstance(handle, axon_nb.TrainHandle)
    try:
        _wait_for_steps(handle, 5)
    except AssertionError:
        handle.stop()  # leave no run going to the tests after this one
        raise
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(timeout=0.2)  # says so, and leaves the run going
    assert not handle.done
    stopped = handle.stop()
    assert stopped.stopped and 5 <= stopped.step < LONG
    states = pooled_cluster_2.run(_state)
    assert [s["step"] for s in states] == [stopped.step] * 2
    assert all(torch.equal(v, states[1]["params"][k]) for k, v in states[0]["params"].items())

    resumed = pooled_cluster_2.train(**ARGS, steps=10, resume=True)
    assert resumed.status == "finished" and resumed.start_step == stopped.step
    assert resumed.step == stopped.step + 10
    ref = axon_nb.train_local(**ARGS, steps=stopped.step + 10)  # never interrupted
    assert resumed.losses == pytest.approx(ref.losses[stopped.step :], abs=1e-5)
    params = pooled_cluster_2.run(_state)[0]["params"]
    for k, v in ref.model.state_dict().items():
        assert torch.allclose(params[k], v, atol=1e-5), k


def _stepping(cluster: axon_nb.Cluster, name: str) -> bool:
    """Whether run ``name`` made a step."""
    run = cluster.last_run
    return run is not None and run.name == name and bool(run.history)


def test_ctrl_c_stops_every_rank_at_one_step_and_keeps_the_model(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    stop = ctrl_c_when(lambda: _stepping(pooled_cluster_2, "interrupted"))
    try:
        result = pooled_cluster_2.train(**ARGS, steps=LONG, name="interrupted")
    except KeyboardInterrupt:  # (escaping, it would end this pytest worker)
        pytest.fail("Ctrl-C during train raised instead of stopping the run at a step")
    finally:
        stop.set()
    assert result.stopped and 0 < result.steps < LONG
    states = pooled_cluster_2.run(_state, "interrupted")
    assert [s["step"] for s in states] == [result.step] * 2
    again = pooled_cluster_2.train(**ARGS, steps=3, name="interrupted", resume=True)
    assert again.step == result.step + 3  # the world and the model still work


def test_stop_at_once_after_block_false_stops_after_the_first_step(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """``stop()`` while the run is still on its way to the ranks (its loss takes 1.5 s to
    unpickle there): it waits for every rank to begin, then stops them at the first step
    boundary, where a SIGINT sent at once would have interrupted the unpickling and failed
    the run."""
    slow = {**ARGS, "loss": ArrivesSlowly(slow_mse(0.05), 1.5)}  # (and 50 ms a step)
    handle = pooled_cluster_2.train(**slow, steps=LONG, name="stopped_early", block=False)
    stopped = handle.stop(timeout=120)
    assert stopped.stopped and 1 <= stopped.step < 100  # (within seconds of the first step)
    states = pooled_cluster_2.run(_state, "stopped_early")
    assert [s["step"] for s in states] == [stopped.step] * 2


def test_resume_takes_a_new_learning_rate(pooled_cluster_2: axon_nb.Cluster) -> None:
    pooled_cluster_2.train(**ARGS, steps=3, name="tuned")
    args = {**ARGS, "optimizer": ("adamw", {"lr": 1e-4})}
    result = pooled_cluster_2.train(**args, steps=3, name="tuned", resume=True)
    assert [h["lr"] for h in result.history] == [1e-4] * 3
    assert [s["lr"] for s in pooled_cluster_2.run(_state, "tuned")] == [1e-4] * 2


def test_metrics_stream_follows_the_documented_schema(pooled_cluster_2: axon_nb.Cluster) -> None:
    steps = 150
    handle = pooled_cluster_2.train(**ARGS, steps=steps, metrics_interval_s=0.1, block=False)
    seen: set[str] = set()
    while not handle.done:
        seen |= {m["status"] for m in handle.latest.values()}
        time.sleep(0.05)
    until(lambda: handle.dashboard.frozen, 30)  # the monitor's last read freezes it
    streamed = handle.history  # from the stream: wait() has not been called
    latest = handle.latest
    result = handle.wait()

    assert "running" in seen
    assert [m["status"] for m in latest.values()] == ["finished", "finished"]
    message = latest[1]
    assert message["schema"] == SCHEMA and message["rank"] == 1 and message["step"] == steps
    assert message["total_steps"] == message["start_step"] + steps
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "rss_bytes"} <= set(message["memory"])
    assert message["memory"]["grad_bytes"] == message["memory"]["param_bytes"]
    assert message["memory"]["optimizer_bytes"] >= 2 * message["memory"]["param_bytes"]
    assert message["comm_totals"]["all_reduce"]["count"] == 2 * steps
    # Throttled, yet nothing lost: every step arrived through the stream.
    assert [h["step"] for h in streamed] == [h["step"] for h in result.history]
    assert [h["loss"] for h in streamed] == result.losses
    entry = streamed[-1]
    assert set(entry) >= {"step", "loss", "lr", "samples", "samples_per_s", "comm_bytes"}
    assert len(entry["per_rank"]["loss"]) == 2
    assert entry["loss"] == pytest.approx(sum(entry["per_rank"]["loss"]) / 2)


def test_a_model_factory_failing_on_one_rank_names_it_and_loses_nothing(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    pooled_cluster_2.train(**ARGS, steps=2, name="kept")
    before = pooled_cluster_2.run(_state, "kept")
    with pytest.raises(axon_nb.RankError, match="rank 1 raised RuntimeError: factory broke") as e:
        pooled_cluster_2.train(**{**ARGS, "model": failing_on_rank(1)}, steps=2, name="kept")
    assert e.value.rank == 1 and e.value.failed_ranks == [1]
    after = pooled_cluster_2.run(_state, "kept")
    assert [s["step"] for s in after] == [2, 2]
    assert all(torch.equal(v, after[0]["params"][k]) for k, v in before[0]["params"].items())


def test_bad_input_is_refused_with_what_to_do(pooled_cluster_2: axon_nb.Cluster) -> None:
    with pytest.raises(ValueError, match="unknown strategy 'zero9'"):
        pooled_cluster_2.train(**ARGS, steps=2, strategy="zero9")
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        pooled_cluster_2.train(**{**ARGS, "optimizer": ("adamm", {})}, steps=2)
    with pytest.raises(ValueError, match=r"batch_size=33 .* world_size x grad_accum = 2 x 1"):
        pooled_cluster_2.train(**{**ARGS, "batch_size": 33}, steps=2)
    small = {**ARGS, "data": lambda: make_data(20)}
    with pytest.raises(axon_nb.RankError, match=r"the dataset has 20 samples.*each rank's shard"):
        pooled_cluster_2.train(**small, steps=2)
    with pytest.raises(axon_nb.RankError, match="no training run named 'never'"):
        pooled_cluster_2.train(**ARGS, steps=2, name="never", resume=True)
    unpaired = {**ARGS, "data": lambda: torch.utils.data.TensorDataset(torch.randn(64, 8))}
    with pytest.raises(axon_nb.RankError, match=r"\(input, target\) pair"):
        pooled_cluster_2.train(**unpaired, steps=2)
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]  # still usable


def test_a_one_rank_cluster_trains_like_train_local() -> None:
    with axon_nb.Cluster(n=1, timeout=60) as one:
        assert one.run(lambda: 7) == [7]  # one rank's results are not wrapped in lists
        result = one.train(**ARGS, steps=5)
        states = one.run(_state)
    ref = axon_nb.train_local(**ARGS, steps=5)
    assert result.losses == pytest.approx(ref.losses, abs=1e-6)
    assert all(torch.allclose(states[0]["params"][k], v) for k, v in ref.model.state_dict().items())


def test_the_dashboard_follows_a_real_run_and_shows_a_failed_rank(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    result = pooled_cluster_2.train(**ARGS, steps=40, metrics_interval_s=0.1, name="watched")
    dashboard = result.dashboard
    assert dashboard is pooled_cluster_2.last_run.dashboard
    assert dashboard.frozen and dashboard.progress["step"] == result.step
    assert [r["status"] for r in dashboard.ranks] == ["finished", "finished"]
    assert dashboard.loss["global"] == pytest.approx(result.losses)

    failing = {**ARGS, "loss": mse_failing_at(20, 1)}
    with pytest.raises(axon_nb.RankError, match="rank 1 raised FloatingPointError"):
        pooled_cluster_2.train(**failing, steps=40, metrics_interval_s=0.1, name="failing")
    until(
        lambda: pooled_cluster_2.last_run.dashboard.frozen, 5
    )  # the monitor delivers the run's end
    ranks = {r["rank"]: r for r in pooled_cluster_2.last_run.dashboard.ranks}
    assert ranks[1]["status"] == "failed" and "loss diverged" in ranks[1]["error"]


def test_the_dashboard_ends_with_each_rank_status_when_it_trails_the_result(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """A rank's last publication (its final status) leaves on the engine's IOPub thread, its
    result on the shell socket; on a loaded machine the result comes first. The dashboard
    froze at that moment with the ranks "running" (the Notebook 7 browser test then waited in
    vain for "stopped"). Here the IOPub thread is held from the last step on."""
    steps = 12
    args = {**ARGS, "loss": mse_holding_iopub_at(steps, seconds=2.0)}
    result = pooled_cluster_2.train(**args, steps=steps, metrics_interval_s=0.1, name="trailing")
    dashboard = result.dashboard
    assert dashboard.frozen
    assert [r["status"] for r in dashboard.ranks] == ["finished", "finished"]
    assert dashboard.progress["step"] == result.step == steps
