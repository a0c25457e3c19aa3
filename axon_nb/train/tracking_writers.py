"""The two experiment trackers ``train(log_to=...)`` writes to, behind one small interface:
``write(step, scalars)`` queues one step's values, ``flush()`` sends what is queued,
``close(status)`` ends the run. Neither imports torch: TensorBoard events are written with
TensorBoard's own event writer (``torch.utils.tensorboard`` would import torch in the kernel),
MLflow's through ``MlflowClient``. Both are imported only when a run asks for them.

Example::

    writer = TensorBoardWriter("runs/gpt", {"steps": 100, "optimizer": "adamw"})
    writer.write(1, {"train/loss": 2.3})
    writer.close("FINISHED")
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

Params = dict[str, str | int | float | bool]
"""A run's configuration, flattened: hyperparameters (TensorBoard) and params (MLflow)."""

MLFLOW_BATCH = 1000
"""Metrics per ``log_batch`` request (MLflow's own limit)."""
MLFLOW_PARAMS_BATCH = 100
"""Params per ``log_batch`` request (MLflow's own limit)."""
MLFLOW_DB = "mlflow.db"
"""The local MLflow store under ``log_dir`` when ``MLFLOW_TRACKING_URI`` is not set."""


class Writer(Protocol):
    """One tracker of a run."""

    name: str

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Queue ``scalars`` at ``step``."""

    def flush(self) -> None:
        """Send everything queued."""

    def close(self, status: str) -> None:
        """Flush and end the run (``FINISHED``, ``FAILED`` or ``KILLED``)."""


class TensorBoardWriter:
    """Scalars and the run's hyperparameters as TensorBoard events in ``log_dir``.

    The hyperparameters go in as the HParams plugin's session summary, so TensorBoard's HPARAMS
    tab lists this run beside others under the same ``--logdir``.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str, params: Params) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(log_dir, max_queue_size=1000, flush_secs=10)
        self._writer.add_event(
            self._event(wall_time=time.time(), summary=summary_v2.hparams_pb(params))
        )

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        summary = self._summary(value=values)
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str) -> None:
        self._writer.close()


class MlflowWriter:
    """One MLflow run: the configuration as params, every scalar as a metric with its step.

    ``uri`` is the tracking server or store (``MLFLOW_TRACKING_URI``, or a sqlite file under
    ``log_dir``); the experiment is ``MLFLOW_EXPERIMENT_NAME`` when set, else the run's name.
    """

    name = "mlflow"

    def __init__(
        self, uri: str, *, experiment: str, run_name: str, params: Params, log_dir: str
    ) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            local = uri.startswith("sqlite:")  # beside the store; a server keeps its own
            where = Path(log_dir, "mlartifacts").as_uri() if local else None
            experiment_id = self._client.create_experiment(experiment, artifact_location=where)
        run = self._client.create_run(experiment_id, run_name=run_name, tags={"axon_nb": "1"})
        self.run_id: str = run.info.run_id
        """The MLflow run's id (``MlflowClient().get_run(run_id)``)."""
        listed = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(listed), MLFLOW_PARAMS_BATCH):
            self._client.log_batch(self.run_id, params=listed[i : i + MLFLOW_PARAMS_BATCH])
        self._pending: list[Any] = []

    def write(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self._pending += [self._metric(metric_key(k), v, now, step) for k, v in scalars.items()]

    def flush(self) -> None:
        while self._pending:
            batch = self._pending[:MLFLOW_BATCH]
            self._client.log_batch(self.run_id, metrics=batch)
            del self._pending[: len(batch)]

    def close(self, status: str) -> None:
        self.flush()
        self._client.set_terminated(self.run_id, status)


def metric_key(tag: str) -> str:
    """``tag`` with the characters MLflow refuses in a key replaced by ``_``::

    metric_key("eval/top-1 (%)")  # "eval/top-1 _%_"
    """
    return re.sub(r"[^\w\-./ ]", "_", tag)


def local_store(log_dir: str) -> str:
    """The MLflow tracking URI of the store under ``log_dir`` (a sqlite file)."""
    return "sqlite:///" + os.path.join(os.path.abspath(log_dir), MLFLOW_DB)
