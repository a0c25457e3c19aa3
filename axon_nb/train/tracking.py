"""Experiment tracking, from the kernel: ``train(..., log_to=["tensorboard", "mlflow"])``.

The kernel already receives every rank's step records (the metrics stream, then each rank's
summary), so the trackers are written here, once per step, and the ranks do nothing more: no
host sync, no file or network on a rank. A :class:`Tracker` listens to a run's
:class:`~axon_nb.train.handle.TrainHandle` and hands each publication to its own thread, which
writes a step once every rank's record of it has come in:

- ``train/loss``, ``train/lr``, ``train/grad_norm`` (with ``clip_grad_norm``),
  ``train/samples_per_s`` from the lowest rank's record, ``train/step_time_s`` (the slowest
  rank's), ``eval/<metric>`` at evaluated steps;
- per rank ``rank<r>/comm_bytes``, ``rank<r>/comm_time_s``, ``rank<r>/step_time_s``, and at
  each publication ``rank<r>/memory/<figure>`` (bytes: ``param_bytes``, ``peak_bytes``, ...).

The run's configuration (:func:`run_params`) goes in as TensorBoard hyperparameters and MLflow
params. What the stream did not bring (``metrics_interval_s=0`` streams nothing) is written at
the end from the ranks' summaries. MLflow writes to ``MLFLOW_TRACKING_URI`` when set, else to a
sqlite store under ``log_dir``; a server that cannot be reached is warned about and left out,
and a tracker that fails while the run goes on is dropped with a warning: training never
waits for a tracker.

Example::

    result = cluster.train(model=make_model, data=ds, steps=100, batch_size=32,
                           log_to=["tensorboard", "mlflow"], log_dir="runs/mlp")
    # tensorboard --logdir runs      mlflow ui --backend-store-uri sqlite:///runs/mlp/mlflow.db
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeGuard

from axon_nb.spec.train_spec import TrainSpec
from axon_nb.train.tracking_messages import (
    Begin,
    End,
    Followed,
    Message,
    Publication,
    Resized,
    RunDone,
)  # fmt: skip
from axon_nb.train.tracking_writers import (
    MlflowWriter,
    Params,
    TensorBoardWriter,
    Writer,
    local_store,
)

INSTALL = "pip install 'axon_nb[track]'"
"""The extra that brings the trackers."""
REACH_S = 3.0
"""How long to try to connect to an MLflow server before the run starts."""
WAIT_S = 120.0
"""How long ``train`` waits, after the run, for the trackers to finish writing."""


def open_tracker(spec: TrainSpec) -> Tracker | None:
    """A :class:`Tracker` for ``spec.log_to``, checked before anything runs.

    Raises ``ImportError`` naming the extra when a requested tracker is not installed; warns
    and leaves MLflow out when ``MLFLOW_TRACKING_URI`` names an http(s) server that does not
    answer (None when nothing is left to write to).
    """
    log_to = spec.log_to or ()
    uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    missing = [m for t in log_to for m in _modules(t, uri) if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"log_to={list(log_to)} writes with {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL}"
        )
    if "mlflow" in log_to and uri is not None and (why := unreachable(uri)) is not None:
        warnings.warn(
            f"MLflow server {uri} (MLFLOW_TRACKING_URI) cannot be reached ({why}): this run is "
            "not logged to MLflow"
            + (", only to TensorBoard" if "tensorboard" in log_to else "")
            + "; training goes on",
            stacklevel=3,
        )
        log_to = tuple(t for t in log_to if t != "mlflow")
    if not log_to:
        return None
    assert spec.log_dir is not None  # (normalize gives log_to a log_dir)
    return Tracker(spec, log_to, mlflow_uri=uri or local_store(spec.log_dir))


def _modules(tracker: str, uri: str | None) -> list[str]:
    if tracker == "tensorboard":
        return ["tensorboard"]
    return ["mlflow"] + (["sqlalchemy", "alembic"] if uri is None else [])  # its local store


def unreachable(uri: str) -> str | None:
    """Why the http(s) tracking server ``uri`` cannot be reached, or None (also for stores
    that are not servers)::

        unreachable("http://127.0.0.1:1")  # "[Errno 111] Connection refused"
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=REACH_S).close()
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__
    return None


def run_params(spec: TrainSpec, world_size: int) -> Params:
    """The configuration of a run as flat hyperparameters (numbers, flags and text)::

    run_params(spec, 2)["optimizer.lr"]  # 0.0003
    """
    optimizer = spec.optimizer
    params: dict[str, Any] = {
        "name": spec.name,
        "strategy": spec.strategy.describe(),
        "world_size": world_size,
        "model": _label(spec.model),
        "data": _label(spec.data),
        "loss": _label(spec.loss) if spec.loss is not None else "model's own",
        "optimizer": optimizer[0] if isinstance(optimizer, tuple) else _label(optimizer),
        **{f"optimizer.{k}": v for k, v in spec.optimizer_kwargs.items()},
    }
    for key in ("steps", "batch_size", "grad_accum", "mixed_precision", "clip_grad_norm",
                "loss_normalization", "no_decay", "compile", "schedule", "warmup_steps", "seed",
                "resume", "eval_every", "checkpoint_every", "max_restarts"):  # fmt: skip
        params[key] = getattr(spec, key)
    if spec.scheduler is not None:
        params["scheduler"] = _label(spec.scheduler)
    if spec.metrics:
        params["metrics"] = ", ".join(spec.metrics)
    return {k: _hparam(v) for k, v in params.items()}


def _label(value: Any) -> str:
    """A short name for an object of the run (a class, function or partial)."""
    target = getattr(value, "func", value)  # functools.partial
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return str(name)


def _hparam(value: Any) -> str | int | float | bool:
    if isinstance(value, bool | int | float | str):
        return value
    return "None" if value is None else repr(value)[:250]


def step_scalars(records: dict[int, dict[str, Any]]) -> dict[str, float]:
    """One step's scalars from its records by rank (global figures from the lowest rank)::

    step_scalars({0: record0, 1: record1})["train/loss"]
    """
    first = records[min(records)]
    out = {
        "train/loss": first.get("loss"),
        "train/lr": first.get("lr"),
        "train/grad_norm": first.get("grad_norm"),
        "train/samples_per_s": first.get("samples_per_s"),
        "train/step_time_s": max(r.get("step_time_s") or 0.0 for r in records.values()),
    }
    evaluated: dict[str, Any] = next(
        (r["eval"] for _, r in sorted(records.items()) if r.get("eval")), {}
    )
    out |= {f"eval/{k}": v for k, v in evaluated.items() if k != "samples"}
    for rank, record in sorted(records.items()):
        for key in ("comm_bytes", "comm_time_s", "step_time_s"):
            out[f"rank{rank}/{key}"] = record.get(key)
    return {k: float(v) for k, v in out.items() if _number(v)}


def memory_scalars(rank: int, memory: dict[str, Any] | None) -> dict[str, float]:
    """A rank's memory figures (bytes) as ``rank<r>/memory/<figure>``."""
    return {f"rank{rank}/memory/{k}": float(v) for k, v in (memory or {}).items() if _number(v)}


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Tracker:
    """Writes one run to its trackers, from a thread of its own.

    ``follow(handle, world_size)`` adds a listener to the run's handle that only queues what
    it hears; a run restarted after a dead rank is followed again, and the steps it computes
    again are not written twice. Example::

        tracker = open_tracker(spec)
        tracker.follow(handle, world_size=2)
        handle.wait(); tracker.wait()   # every step written
    """

    def __init__(self, spec: TrainSpec, log_to: Sequence[str], *, mlflow_uri: str) -> None:
        self._spec = spec
        self._log_to = tuple(log_to)
        self._mlflow_uri = mlflow_uri
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._writers: list[Writer] = []
        self._records: dict[int, dict[int, dict[str, Any]]] = {}
        """The current run's records: rank -> step -> record."""
        self._world = 0
        self._written: set[int] = set()
        self._memory_at: dict[int, int] = {}
        """The step of each rank's memory figures last written."""
        self._follows = 0

    def follow(self, handle: Followed, world_size: int, *, last: bool = True) -> None:
        """Write the run of ``handle`` (on ``world_size`` ranks); with ``last``, its end ends
        the tracked run (else :meth:`end` does)."""
        self._follows += 1
        self._queue.put(Begin(self._follows, world_size))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="axon-tracking", daemon=True)
            self._thread.start()
        handle.add_listener(_Feed(self._queue, self._follows, handle, last))

    def end(self, status: str = "FINISHED") -> None:
        """End the tracked run: write what came in and close the trackers with ``status``."""
        self._queue.put(End(self._follows, status))

    def wait(self, timeout: float = WAIT_S) -> None:
        """Wait until everything is written (the tracked run ended), at most ``timeout``."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn(
                f"the trackers are still writing after {timeout:g} s; they go on in the background",
                stacklevel=2,
            )

    # --- the tracking thread ---

    def _work(self) -> None:
        try:
            self._follow_runs()
        except Exception as e:  # never in the way of training
            _warn(" and ".join(self._log_to), "stopped", e)

    def _follow_runs(self) -> None:
        current = 0
        while True:
            message = self._queue.get()
            if message.follow < current:
                continue  # from a run that a restart replaced
            match message:
                case Begin(follow, world_size):
                    if current == 0:
                        self._open(world_size)
                    current, self._records, self._world = follow, {}, world_size
                case Publication(_, publication):
                    self._take(publication)
                    self._write(ready_only=True)
                case Resized(_, world_size):
                    self._write(ready_only=False)  # (every old-world record is in)
                    self._world = world_size
                case RunDone(_, failures, summaries, last):
                    for summary in summaries:
                        self._take(summary)
                    self._write(ready_only=False)
                    if last:
                        self._close(_status(failures, summaries))
                        return
                case End(_, status):
                    self._write(ready_only=False)
                    self._close(status)
                    return
            if self._queue.empty():
                self._each("flush")

    def _open(self, world_size: int) -> None:
        spec = self._spec
        params = run_params(spec, world_size)
        for name in self._log_to:
            try:
                if name == "tensorboard":
                    self._writers.append(TensorBoardWriter(spec.log_dir or ".", params))
                else:
                    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or spec.name
                    self._writers.append(
                        MlflowWriter(
                            self._mlflow_uri,
                            experiment=experiment,
                            run_name=spec.name,
                            params=params,
                            log_dir=spec.log_dir or ".",
                        )
                    )
            except Exception as e:
                _warn(name, "could not start", e)

    def _take(self, message: dict[str, Any]) -> None:
        """Keep a publication's (or summary's) records; write its memory figures once."""
        rank = message["rank"]
        held = self._records.setdefault(rank, {})
        for record in message.get("records") or ():
            if record["step"] not in self._written:  # (a publication repeats the one before)
                held[record["step"]] = record
        step = message.get("step")
        memory = memory_scalars(rank, message.get("memory"))
        if memory and isinstance(step, int) and step > self._memory_at.get(rank, -1):
            self._memory_at[rank] = step
            self._each("write", step, memory)

    def _write(self, *, ready_only: bool) -> None:
        """Write each step not written yet whose records every rank sent (at the end: every
        step any rank sent), in step order."""
        steps = sorted({s for held in self._records.values() for s in held} - self._written)
        for step in steps:
            records = {r: held[step] for r, held in self._records.items() if step in held}
            if ready_only and len(records) < self._world:
                break  # later steps wait for this one, so each tag's steps stay in order
            self._written.add(step)
            for held in self._records.values():
                held.pop(step, None)
            self._each("write", step, step_scalars(records))

    def _each(self, method: str, *args: Any) -> None:
        for writer in list(self._writers):
            try:
                getattr(writer, method)(*args)
            except Exception as e:
                self._writers.remove(writer)
                _warn(writer.name, "failed", e)

    def _close(self, status: str) -> None:
        self._each("close", status)
        self._writers = []


class _Feed:
    """What the handle of one run calls (from its monitor thread): it only queues."""

    def __init__(
        self, into: queue.SimpleQueue[Message], follow: int, handle: Followed, last: bool
    ) -> None:
        self._queue, self._follow, self._handle, self._last = into, follow, handle, last

    def message(self, rank: int, message: dict[str, Any]) -> None:
        self._queue.put(Publication(self._follow, {"rank": rank, **message}))

    def tick(self) -> None:
        pass

    def resized(self, old: int, new: int, step: int) -> None:
        self._queue.put(Resized(self._follow, new))

    def done(self, failures: dict[int, str]) -> None:
        summaries = self._handle.summaries()
        self._queue.put(RunDone(self._follow, failures, summaries, self._last))


def _status(failures: dict[int, str], summaries: list[dict[str, Any]]) -> str:
    if failures:
        return "FAILED"
    return "KILLED" if any(s.get("status") == "stopped" for s in summaries) else "FINISHED"


def _warn(tracker: str, what: str, error: Exception) -> None:
    warnings.warn(
        f"{tracker} {what} ({type(error).__name__}: {error}): the run is no longer logged to "
        f"{tracker}; training goes on",
        stacklevel=2,
    )


@contextlib.contextmanager
def ending(tracker: Tracker | None, *, end: bool) -> Iterator[None]:
    """Around waiting for a tracked run: afterwards, end it (``end``, or when the body
    raised: then as failed) and wait until the trackers have written everything."""
    if tracker is None:
        yield
        return
    try:
        yield
    except BaseException:
        tracker.end("FAILED")
        raise
    else:
        if end:
            tracker.end("FINISHED")
    finally:
        tracker.wait()
