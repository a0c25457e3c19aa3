"""``TrainHandle``: a training run in progress on the ranks, seen from the kernel."""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import ipyparallel as ipp

from axon_nb.cluster.hangs import HangWatch
from axon_nb.cluster.waiting import describe_error, results
from axon_nb.errors import AxonError, RankError
from axon_nb.spec.train_spec import TrainSpec
from axon_nb.train.progress import ProgressBar
from axon_nb.train.result import TrainResult, build_result, merge_records
from axon_nb.train.trace_report import trace_table
from axon_nb.widgets.dashboard import Dashboard

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

MONITOR_S = 0.1
"""How often the kernel-side monitor thread reads the ranks' metrics stream."""
SOFT_STOP_S = 120.0
"""After Ctrl-C or ``stop()``, how long ranks get to reach the next step boundary."""
LAST_PUBLICATION_S = 10.0
"""Once a rank's result is in, how long its last publication (its final status) may trail it:
the publication goes out on the engine's IOPub thread, the result on its shell socket."""
FINAL_STATUSES = ("finished", "stopped", "failed")
"""A rank's status in its last publication of a run (``axon_nb.metrics/1``)."""


class MetricsListener(Protocol):
    """Receives the metrics stream of one run (called from the monitor thread)."""

    def message(self, rank: int, message: dict[str, Any]) -> None:
        """One publication of ``rank`` (schema ``axon_nb.metrics/1``)."""

    def tick(self) -> None:
        """Called on every monitor poll (about ``MONITOR_S``), messages or not."""

    def done(self, failures: dict[int, str]) -> None:
        """The run ended; ``failures`` maps failed ranks to their error."""


class TrainHandle:
    """A run started with ``cluster.train(..., block=False)``.

    The ranks are busy until it ends: other work sent to them (``%%axon`` cells,
    ``cluster.run``) waits in their queue behind it.

    Example::

        handle = cluster.train(model=make_model, data=ds, steps=1000, block=False)
        handle.history[-1]["loss"]    # what has streamed in so far
        result = handle.stop()        # all ranks stop at the same step; the model stays usable
    """

    def __init__(
        self,
        cluster: ClusterLike,
        ar: ipp.AsyncResult,
        targets: list[int],
        spec: TrainSpec,
        run: str,
        *,
        interrupted: bool = False,
        label: str | None = None,
    ) -> None:
        self._cluster = cluster
        self._client = cluster.client
        """The client the run went out on: once the cluster stops or restarts, its results
        never come, and the monitor ends."""
        self._interrupted = interrupted
        """A Ctrl-C came while the run was being sent: the first wait delivers it."""
        self._ar = ar
        self._targets = targets
        self._spec = spec
        self._run = run
        self._parts = dict(zip(targets, ar.split(), strict=True))
        self._records: dict[int, dict[int, dict[str, Any]]] = {r: {} for r in targets}
        self._latest: dict[int, dict[str, Any]] = {}
        self._result: TrainResult | None = None
        self.shown = False
        """True once the dashboard is displayed (then no text bar is drawn)."""
        self._bar = ProgressBar(label or f"train {spec.name}", spec.steps)
        """The text bar drawn where no dashboard is shown (a terminal; a kernel's compare)."""
        self._listeners: list[MetricsListener] = []
        self.restart_on_death = False
        """Set by automatic recovery (``max_restarts``), which restarts every rank when one
        dies: the wait then ends at the death, without bringing the survivors to rest."""
        self._ended: dict[int, str] | None = None
        """The failures the listeners were told of at the run's end (None while it runs)."""
        hosts = len({r.get("host") for r in cluster.ranks})
        where = f" on {hosts} hosts" if hosts > 1 else ""
        self.dashboard = Dashboard(
            len(targets), title=f"{spec.name} · {spec.strategy.name} · {len(targets)} ranks{where}"
        )
        """The live widget of this run; display it (``%axon_dashboard``) to watch."""
        self._listeners.append(self.dashboard)
        self._lock = threading.Lock()
        hang_timeout = cluster.options.hang_timeout
        self._hang = HangWatch(hang_timeout, self._on_hang) if hang_timeout is not None else None
        self._hang_at: object = None
        """The steps when a hang was last reported (the dashboard shows it until they change)."""
        self._failed = threading.Event()
        """Set when :meth:`wait` raised a rank's failure: the monitor stops, even with ranks
        still running (a rank died and recovery restarts them all, or one is stuck)."""
        # Each publication repeats only the previous one's records, so read them well within
        # two publication intervals, whether or not anyone is looking.
        self._monitor = threading.Thread(target=self._watch, name="axon-train-monitor", daemon=True)
        self._monitor.start()

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def done(self) -> bool:
        """True once every rank has finished (or failed)."""
        return self._ar.ready()

    @property
    def history(self) -> list[dict[str, Any]]:
        """Steps streamed so far, in :class:`TrainResult`'s ``history`` format."""
        if self._result is not None:
            return self._result.history
        self.poll()
        with self._lock:
            return merge_records(self._records)

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        """Each rank's latest publication without its records (status, step, memory, ...)."""
        self.poll()
        return dict(self._latest)

    def poll(self) -> None:
        """Read what the ranks have published since the last poll."""
        with self._lock:
            self._read()

    def add_listener(self, listener: MetricsListener) -> None:
        """Send every new publication, and the run's end, to ``listener`` (a dashboard)."""
        with self._lock:
            self._listeners.append(listener)
            for rank, message in self._latest.items():  # catch up on what came before
                listener.message(rank, {**message, "records": list(self._records[rank].values())})
            if self._ended is not None:
                listener.done(self._ended)

    def summaries(self) -> list[dict[str, Any]]:
        """What each rank that finished returned (rank order, once :attr:`done`): its step
        records, memory and totals, which the result is built from."""
        parts = sorted(self._parts.items())
        return [part.get() for _, part in parts if part.ready() and part.successful()]

    def _cluster_gone(self) -> bool:
        """The ranks the run went to are gone (the cluster stopped or restarted)."""
        try:
            return not self._cluster.running or self._cluster.client is not self._client
        except AxonError:  # stopping just now: its client is gone before its ranks
            return True

    def _watch(self) -> None:
        while not self._ar.ready() and not self._failed.is_set() and not self._cluster_gone():
            self.poll()
            with self._lock:
                for listener in self._listeners:
                    listener.tick()
            if self._hang is not None:
                self._check_hang()
            time.sleep(MONITOR_S)
        self._wait_for_last_publications()
        self.poll()
        self._clear_hang(self._steps())
        failures = {
            rank: "{}: {}".format(*describe_error(part.exception()))
            for rank, part in self._parts.items()
            if part.ready() and not part.successful()
        }
        if not self._ar.ready() and self._cluster_gone():
            gone = {
                r: "the cluster stopped or restarted"
                for r, p in self._parts.items()
                if not p.ready()
            }
            failures.update(gone)
        with self._lock:
            self._ended = failures
            for listener in self._listeners:
                listener.done(failures)

    def _wait_for_last_publications(self) -> None:
        """Wait until the finished ranks' last publications are in: read before them, the
        dashboard froze with a rank "running" whose result said "stopped". A rank that failed
        is shown failed from its error.

        Each rank's last publication carries its final status, so that is what is waited for
        (or ipyparallel's word that the call's output is complete, whichever comes first).
        That word waits for the engine's idle status, which never came once the client had
        stopped reading IOPub (``cluster/iopub_guard.py`` now keeps it reading), and each run
        then waited ``LAST_PUBLICATION_S`` for nothing."""
        finished = {r: p for r, p in self._parts.items() if p.ready() and p.successful()}
        end = time.monotonic() + LAST_PUBLICATION_S
        while time.monotonic() < end:
            self.poll()
            with self._lock:
                final = all(
                    self._latest.get(r, {}).get("status") in FINAL_STATUSES for r in finished
                )
            if final or all(p.wait_for_output(0) for p in finished.values()):
                return
            if self._cluster_gone():  # (what has not come will not)
                return
            time.sleep(MONITOR_S / 5)

    def _steps(self) -> tuple[tuple[int, int], ...]:
        with self._lock:
            return tuple(sorted((rank, m["step"]) for rank, m in self._latest.items()))

    def _check_hang(self) -> None:
        """Report once when no rank finished a step for ``hang_timeout`` (monitor thread)."""
        assert self._hang is not None
        steps = self._steps()
        self._clear_hang(steps)
        self._hang.check(steps)

    def _clear_hang(self, steps: object) -> None:
        if self._hang_at is not None and steps != self._hang_at:
            self._hang_at = None
            self.dashboard.show_hang("")  # moving again

    def _on_hang(self, seconds: float) -> None:
        # In its own thread: taking the stacks may take seconds, and the monitor must keep
        # reading the stream meanwhile (a publication repeats only the previous one's records).
        self._hang_at = self._steps()
        threading.Thread(
            target=self._report_hang, args=(seconds,), name="axon-hang-report", daemon=True
        ).start()

    def _report_hang(self, seconds: float) -> None:
        report = self._cluster.report_hang(seconds, progress="no rank finished a step")
        if report is not None and not self.done and self._hang_at == self._steps():
            self.dashboard.show_hang(f"No step for {seconds:.0f} s. {report.format()}")

    def _read(self) -> None:
        for rank, part in self._parts.items():
            data = part.data
            if isinstance(data, list):  # single-target results may still wrap in a list
                data = data[0] if data else {}
            if not data or data.get("run") != self._run:
                continue
            previous = self._latest.get(rank)
            if previous is not None and previous["heartbeat"] == data["heartbeat"]:
                continue  # nothing new from this rank
            self._latest[rank] = {k: v for k, v in data.items() if k != "records"}
            for listener in self._listeners:
                listener.message(rank, data)
            for record in data.get("records", ()):
                self._records[rank][record["step"]] = record

    def wait(self, timeout: float | None = None) -> TrainResult:
        """Block until the run ends and return its result (Ctrl-C stops it at a step boundary).

        With ``timeout``, raise ``TimeoutError`` if it is still running then; it keeps running.
        """
        if self._result is None:
            if timeout is not None and not self._ar.wait(timeout):
                raise TimeoutError(
                    f"training {self.name!r} is still running after {timeout:g} s; call wait() "
                    "again, or stop() to end it at the next step"
                )
            interrupted, self._interrupted = self._interrupted, False
            try:
                parts = self._cluster.wait(
                    self._ar,
                    self._targets,
                    stream=True,
                    tick=self._tick,
                    soft_stop_s=SOFT_STOP_S,
                    watch_hangs=False,  # the monitor thread watches the steps instead
                    interrupted=interrupted,
                    settle_deaths=not self.restart_on_death,
                )
            except RankError:
                self._failed.set()  # (results that may never come are not waited for)
                raise
            finally:
                # The monitor's last read and the dashboard's final state come before the result.
                self._monitor.join(timeout=LAST_PUBLICATION_S + MONITOR_S * 50)
                if not self.shown:
                    self._tick()
                    self._bar.close()
            self._result = build_result(
                results(parts), name=self._spec.name, strategy=self._spec.strategy.describe()
            )
            self._result.dashboard = self.dashboard
            change = self._result.layout_change
            if change:
                print(
                    f"Resharded {self.name!r} from {change['from']} to {change['to']} in "
                    f"{change['seconds']:.1f} s (at step {change['step']})."
                )
            if self._result.traces:
                print(trace_table(self._result.traces))
                self.dashboard.trace_summary = self._result.traces
            if self._result.stopped:
                print(
                    f"Training stopped at step {self._result.step} on every rank; "
                    f"`{self.name}` is usable on the ranks, and train(..., resume=True) "
                    "continues from here.",
                    file=sys.stderr,
                )
        return self._result

    def show(self) -> None:
        """Display the dashboard in the notebook (what ``%axon_dashboard`` does)."""
        from IPython.display import display

        display(self.dashboard)
        self.shown = True

    def stop(self, timeout: float | None = None) -> TrainResult:
        """Stop every rank at the same step boundary and return the result so far."""
        if not self.done:
            self._cluster.interrupt(self._targets)
        return self.wait(timeout)

    def _tick(self) -> None:
        """Redraw the text bar (``train/progress.py``), where no dashboard is shown."""
        if self.shown:
            return
        with self._lock:
            if len(self._latest) < len(self._targets):
                return
            done = min(m["step"] - m["start_step"] for m in self._latest.values())
            records = self._records[self._targets[0]]
            loss = records[max(records)]["loss"] if records else None
        self._bar.update(done, loss=loss)

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        history = self.history
        at = history[-1]["step"] if history else 0
        return f"<TrainHandle {self.name!r} {state}, step {at}>"
