"""``KeptHandle``: a run on a detached cluster read from the cluster's directory, so any
kernel that attaches sees the whole run (``spec/kept_runs.py``: what the ranks keep).

ipyparallel hands a client only the output of its own requests, and a reply sent to a dead
kernel is gone, so the run's publications and the ranks' summaries are read from the files
the ranks write: every publication since the run began (its history), then new ones as they
come, by a monitor thread as ``RunStream`` reads ipyparallel's. ``wait`` returns the
``TrainResult`` the run would have returned to the kernel that started it.

Example::

    handle = cluster.handle("model")   # on a cluster from axon_nb.attach("lab")
    handle.show()                      # the dashboard: the whole run, streaming on
    result = handle.wait()
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axon_nb.cluster.detached import ranks_alive, read_record
from axon_nb.errors import AxonError, RankError
from axon_nb.spec.kept_runs import end_path, read_end, run_dir, stream_path
from axon_nb.train.presenter import RunPresenter
from axon_nb.train.publications import Publications
from axon_nb.train.result import TrainResult, build_result
from axon_nb.train.run_stream import MONITOR_S, MetricsListener
from axon_nb.train.training_begun import wait_until_training

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.widgets.dashboard import Dashboard


class KeptHandle:
    """A run of a detached cluster, from its kept files (see the module doc)."""

    def __init__(
        self,
        root: Path,
        name: str,
        started: dict[str, Any],
        *,
        alive: Callable[[], dict[int, bool]],
        interrupt: Callable[[list[int]], None],
        where: str = "attached",
    ):
        self._alive = alive
        """Whether each rank's process runs now (a rank gone without a summary failed)."""
        self._interrupt = interrupt
        """SIGINT to these ranks: each stops at the same step boundary."""
        self._root = root
        self._name = name
        self._targets: list[int] = list(started["targets"])
        self._started = started
        self._result: TrainResult | None = None
        self._offsets = dict.fromkeys(self._targets, 0)
        self._pending = dict.fromkeys(self._targets, b"")
        self._book = Publications(self._targets)
        self._lock = threading.Lock()
        self._presenter = RunPresenter(
            name, label=f"train {name}", steps=int(started["steps"]),
            world_size=len(self._targets),
            title=f"{name} · {started.get('strategy', '')} · {len(self._targets)} ranks ({where})",
        )  # fmt: skip
        self.add_listener(self._presenter.dashboard)
        self._monitor = threading.Thread(target=self._watch, name="axon-kept-run", daemon=True)
        self._monitor.start()

    @classmethod
    def open(cls, cluster: ClusterLike, root: Path, name: str) -> KeptHandle:
        """Run ``name`` of the detached cluster whose directory is ``root``; an unknown name
        lists the runs there are."""

        def alive() -> dict[int, bool]:
            record = read_record(root)
            return ranks_alive(record) if record is not None else {}

        return cls(root, name, read_started(root, name), alive=alive, interrupt=cluster.interrupt)

    @property
    def name(self) -> str:
        return self._name

    @property
    def done(self) -> bool:
        """True once every rank kept its summary (or one is gone without)."""
        try:
            return self._book.ended is not None or self._finished() is not None
        except RankError:
            return True

    @property
    def dashboard(self) -> Dashboard:
        return self._presenter.dashboard

    @property
    def shown(self) -> bool:
        return self._presenter.shown

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step since the run began, in :class:`TrainResult`'s ``history`` format."""
        self.poll()
        with self._lock:
            return self._book.history()

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        self.poll()
        with self._lock:
            return dict(self._book.latest)

    def poll(self) -> None:
        """Read what the ranks kept since the last poll."""
        with self._lock:
            self._read()

    def add_listener(self, listener: MetricsListener) -> None:
        with self._lock:
            self._book.add_listener(listener)

    def show(self) -> None:
        """Display the dashboard (the whole run so far, then live)."""
        self.poll()
        self._presenter.show()

    def summaries(self) -> list[dict[str, Any]]:
        return [read_end(self._root, self._name, r) for r in self._targets
                if end_path(self._root, self._name, r).exists()]  # fmt: skip

    def wait(self, timeout: float | None = None) -> TrainResult:
        """Block until the run ends; its result, as the kernel that started it would have
        had it. With ``timeout``: ``TimeoutError`` if it still runs then (it keeps running).
        A first Ctrl-C stops every rank at the same step boundary (as for the kernel's own
        runs), a second one stops waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stopping = False
        while self._result is None:
            try:
                if self._wait_once(deadline, timeout):
                    break
            except KeyboardInterrupt:
                if stopping or self.done:
                    raise
                stopping = True
                print(f"(stopping {self._name!r} at the next step; Ctrl-C again to stop waiting)")
                self._interrupt(self._targets)
        assert self._result is not None
        return self._result

    def _wait_once(self, deadline: float | None, timeout: float | None) -> bool:
        """One look: True once the result is built."""
        try:
            finished = self._finished()
        except RankError:
            self._monitor.join(timeout=10 * MONITOR_S + 5)
            self._presenter.close(self._progress)
            raise
        if finished is not None:
            self._monitor.join(timeout=10 * MONITOR_S + 5)
            self._presenter.close(self._progress)
            self._result = self._whole(_result_of(finished, self._name, self._started))
            self._presenter.report(self._result)
            return True
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"training {self._name!r} is still running after {timeout:g} s; call "
                "wait() again, or stop() to end it at the next step"
            )
        self._presenter.tick(self._progress)
        time.sleep(MONITOR_S)
        return False

    def stop(self, timeout: float | None = None) -> TrainResult:
        """Stop every rank at the same step boundary and return the result so far (a run
        that has not begun stops after its first step: ``train/training_begun.py``)."""

        def latest() -> dict[int, Any]:
            self.poll()
            with self._lock:
                return dict(self._book.latest)

        streams = bool(self._started.get("streams", True))  # (a run without publications)
        wait_until_training(self._targets, latest, lambda: self.done, streams=streams)
        if not self.done:
            self._interrupt(self._targets)
        return self.wait(timeout)

    def _whole(self, result: TrainResult) -> TrainResult:
        """``result`` with the steps before its ranks' last start (a job relaunched after a
        preemption: its summaries begin at the checkpoint), from the kept stream."""
        self.poll()
        with self._lock:
            kept = self._book.history()
        first = result.history[0]["step"] if result.history else result.step + 1
        before = [h for h in kept if h["step"] < first]
        if not before:
            return result
        return dataclasses.replace(result, history=[*before, *result.history],
                                   start_step=before[0]["step"] - 1)  # fmt: skip

    def _finished(self) -> dict[int, dict[str, Any]] | None:
        """Each rank's summary once all are kept; a rank gone without one raises."""
        ended = {r: end_path(self._root, self._name, r).exists() for r in self._targets}
        if all(ended.values()):
            return {r: read_end(self._root, self._name, r) for r in self._targets}
        alive = self._alive()
        gone = [r for r, e in ended.items() if not e and not alive.get(r, False)]
        if gone:
            raise RankError(gone[0], "RankDiedError", "its process ended during the run", "", gone)
        return None

    def _progress(self) -> tuple[int, float | None] | None:
        with self._lock:
            return self._book.progress()

    def _watch(self) -> None:
        while True:
            with self._lock:
                self._read()
                self._book.tick()
            try:
                finished = self._finished() is not None
            except RankError as e:
                failures = {e.rank: str(e)}
                break
            if finished:
                self.poll()
                failures = {}
                break
            time.sleep(MONITOR_S)
        with self._lock:
            self._book.end(failures)

    def _read(self) -> None:
        """Hand each rank's new publications to the listeners (with the lock held)."""
        for rank in self._targets:
            for message in self._new_lines(rank):
                if message.get("run") != self._started["run"]:
                    continue  # (an earlier run of the same name, being replaced)
                self._book.take(rank, message)

    def _new_lines(self, rank: int) -> list[dict[str, Any]]:
        path = stream_path(self._root, self._name, rank)
        try:
            with open(path, "rb") as f:
                if f.seek(0, 2) < self._offsets[rank]:  # (a new run of the name replaced it)
                    self._offsets[rank], self._pending[rank] = 0, b""
                f.seek(self._offsets[rank])
                data = self._pending[rank] + f.read()
                self._offsets[rank] = f.tell()
        except OSError:
            return []
        *lines, self._pending[rank] = data.split(b"\n")  # (the last may be half written)
        messages = []
        for line in lines:
            with contextlib.suppress(ValueError):  # (a line of a replaced file, cut)
                messages.append(json.loads(line))
        return messages

    def __repr__(self) -> str:
        history = self.history
        at = history[-1]["step"] if history else 0
        return f"<KeptHandle {self._name!r} {'done' if self.done else 'running'}, step {at}>"


def read_started(root: Path, name: str) -> dict[str, Any]:
    """What the kernel that sent run ``name`` noted of it (``run.json``); an unknown name is
    refused with the runs there are."""
    try:
        started: dict[str, Any] = json.loads((run_dir(root, name) / "run.json").read_text())
    except (OSError, ValueError):
        runs_dir = root / "runs"
        names = sorted(p.name for p in runs_dir.iterdir()) if runs_dir.is_dir() else []
        raise AxonError(
            f"no run named {name!r} here (runs: {', '.join(names) or 'none'})"
        ) from None
    return started


def _result_of(summaries: dict[int, dict[str, Any]], name: str, started: dict[str, Any]
               ) -> TrainResult:  # fmt: skip
    failed = {r: s["error"] for r, s in summaries.items() if "error" in s}
    if failed:
        rank, (ename, evalue, *traceback) = min(failed.items())
        raise RankError(rank, ename, evalue, "".join(traceback), sorted(failed))
    ordered = [summaries[r] for r in sorted(summaries)]
    if any("aborted" in s for s in ordered):
        ordered = [s for s in ordered if "aborted" not in s]
    return build_result(ordered, name=name, strategy=started.get("strategy", ""))
