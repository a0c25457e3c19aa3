"""Experiment tracking (``log_to=["tensorboard", "mlflow"]``, ``log_dir``): a real 2-rank run is
read back with TensorBoard's ``EventAccumulator`` and ``MlflowClient``. Every step is written
once, with the values of ``result.history``, streamed or (``metrics_interval_s=0``) from the
ranks' summaries at the end; an MLflow server that cannot be reached is warned about and the
run goes on; bad options and missing packages are refused before anything runs."""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import needs
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb.train import tracking
from axon_nb.train.tracking_writers import local_store, metric_key

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), needs("tensorboard", "mlflow")]


RUN: dict[str, Any] = dict(
    model=make_mlp,
    data=make_data,
    loss=mse,
    steps=4,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    clip_grad_norm=1.0,
    name="tracked",
)
EVALUATED: dict[str, Any] = dict(
    eval_data=functools.partial(make_data, 40),
    eval_every=2,
    metrics={"mae": lambda output, target: (output - target).abs().mean()},
)


@pytest.fixture(autouse=True)
def no_tracking_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests write to their own ``log_dir``, never to a server the machine has set."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def check_tensorboard(log_dir: Path, result: axon_nb.TrainResult) -> None:
    """Each step once, in order, equal to the result's history (float32 in the events)."""
    acc = events(log_dir)
    history = result.history
    steps = [h["step"] for h in history]
    assert steps == list(range(1, result.steps + 1))
    for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")]:
        written = scalars(acc, tag)
        assert [s for s, _ in written] == steps, tag
        assert [v for _, v in written] == pytest.approx([h[key] for h in history], rel=1e-6)
    assert [s for s, _ in scalars(acc, "train/samples_per_s")] == steps
    for rank in (0, 1):
        comm = scalars(acc, f"rank{rank}/comm_bytes")
        assert comm == [(h["step"], h["per_rank"]["comm_bytes"][rank]) for h in history]
        memory = scalars(acc, f"rank{rank}/memory/param_bytes")
        assert memory and memory[-1] == (result.step, result.memory[rank]["param_bytes"])
    tags = acc.Tags()["scalars"]
    assert not [t for t in tags if t.startswith("rank2")]  # one set per rank, two ranks
    hparams = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams


def mlflow_run(log_dir: Path, name: str = "tracked") -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(local_store(str(log_dir)))
    experiment = client.get_experiment_by_name(name)
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_both_trackers_write_every_step_once_with_the_run_configuration(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    result = pooled_cluster_2.train(
        **RUN, **EVALUATED, log_to=["tensorboard", "mlflow"], log_dir=tmp_path
    )
    check_tensorboard(tmp_path, result)
    acc = events(tmp_path)
    for key in ("loss", "mae"):
        assert scalars(acc, f"eval/{key}") == [
            (e["step"], pytest.approx(e[key], rel=1e-6)) for e in result.evals
        ]
    assert [e["step"] for e in result.evals] == [2, 4]

    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [
        (h["step"], pytest.approx(h["loss"], rel=1e-12)) for h in result.history
    ]
    evals = client.get_metric_history(run.info.run_id, "eval/mae")
    assert [m.step for m in sorted(evals, key=lambda m: m.step)] == [2, 4]
    params = run.data.params
    assert params["steps"] == "4" and params["batch_size"] == "16"
    assert params["optimizer"] == "adamw" and params["optimizer.lr"] == "0.003"
    assert params["world_size"] == "2" and params["strategy"] == result.strategy
    assert params["model"] == "make_mlp" and params["metrics"] == "mae"


def test_without_a_stream_everything_is_written_at_the_end(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    result = pooled_cluster_2.train(
        **RUN, metrics_interval_s=0, log_to="tensorboard", log_dir=tmp_path
    )
    check_tensorboard(tmp_path, result)
    assert not (tmp_path / "mlflow.db").exists()  # only what was asked for


def test_an_unreachable_mlflow_server_warns_and_training_goes_on(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with pytest.warns(UserWarning, match=r"cannot be reached .*only to TensorBoard; training"):
        result = pooled_cluster_2.train(**RUN, log_to=["tensorboard", "mlflow"], log_dir=tmp_path)
    assert result.status == "finished" and result.steps == RUN["steps"]
    check_tensorboard(tmp_path, result)


def test_a_resumed_run_continues_the_same_curves(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    first = pooled_cluster_2.train(**RUN, log_to="tensorboard", log_dir=tmp_path)
    more = {**RUN, "steps": 2}
    second = pooled_cluster_2.train(**more, resume=True, log_to="tensorboard", log_dir=tmp_path)
    written = scalars(events(tmp_path), "train/loss")
    assert [s for s, _ in written] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in written] == pytest.approx(first.losses + second.losses, rel=1e-6)


def test_bad_tracking_options_are_refused_before_anything_runs(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for log_to in ("wandb", ["tensorboard", "comet"], 3):
        with pytest.raises(ValueError, match="log_to takes 'tensorboard' and/or 'mlflow'"):
            pooled_cluster_2.train(**RUN, log_to=log_to, log_dir=tmp_path)
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mlflow" else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"writes with mlflow, .*pip install 'axon_nb\[track\]'"):
        pooled_cluster_2.train(**RUN, log_to=["tensorboard", "mlflow"], log_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was written, nothing ran
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_step_scalars_take_global_figures_from_the_lowest_rank() -> None:
    def record(rank: int) -> dict[str, Any]:
        return {"step": 3, "loss": 0.5, "lr": 0.1, "grad_norm": None, "step_time_s": 0.1 + rank,
                "samples_per_s": 100.0 - rank, "comm_bytes": 10 * rank, "comm_time_s": 0.0,
                "eval": {"loss": 0.4, "acc": 0.9, "samples": 40} if rank else None}  # fmt: skip

    out = tracking.step_scalars({1: record(1), 0: record(0)})
    assert out["train/samples_per_s"] == 100.0 and out["train/step_time_s"] == 1.1
    assert "train/grad_norm" not in out  # no clipping: no norm
    assert out["eval/acc"] == 0.9 and "eval/samples" not in out
    assert out["rank1/comm_bytes"] == 10.0
    memory = tracking.memory_scalars(1, {"param_bytes": 8, "device": "cpu"})
    assert memory == {"rank1/memory/param_bytes": 8.0}
    assert metric_key("eval/top-1 (%)") == "eval/top-1 ___"
    assert tracking.unreachable("sqlite:///x.db") is None


KERNEL = """
import sys
from axon_nb.spec.make import make_spec
from axon_nb.strategies import DDP
from axon_nb.train.tracking import open_tracker

spec = make_spec(DDP, model=print, data=print, steps=2, batch_size=4,
                 log_to=["tensorboard", "mlflow"], log_dir=sys.argv[1])

class Handle:
    def add_listener(self, listener):
        self.listener = listener
    def summaries(self):
        return [{"rank": r, "step": 2, "memory": {"rss_bytes": 9}, "records": []} for r in (0, 1)]

record = {"lr": 0.1, "samples_per_s": 8.0, "step_time_s": 0.5, "comm_bytes": 4}
tracker, handle = open_tracker(spec), Handle()
tracker.follow(handle, 2)
handle.listener.message(0, {"rank": 0, "records": [{**record, "step": 1, "loss": 1.0}]})
handle.listener.message(1, {"rank": 1, "records": [{**record, "step": 1, "loss": 1.0},
                                                   {**record, "step": 2, "loss": 0.5}]})
handle.listener.message(0, {"rank": 0, "records": [{**record, "step": 2, "loss": 0.5}]})
handle.listener.done({})
tracker.wait()
assert "torch" not in sys.modules, "the trackers imported torch"
"""


def test_the_trackers_never_import_torch_in_the_kernel(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", KERNEL, str(tmp_path)], check=True, timeout=240)
    assert scalars(events(tmp_path), "train/loss") == [(1, 1.0), (2, 0.5)]
    assert scalars(events(tmp_path), "rank1/memory/rss_bytes") == [(2, 9.0)]
    client, run = mlflow_run(tmp_path, "model")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 0.5]
