"""``RunStream``: what the ranks of one run publish while it trains, read from the kernel.

Each rank publishes its status, memory and the step records since its last publication
(schema ``axon_nb.metrics/1``) with ipyparallel's ``publish_data``, at most every
``metrics_interval_s``. A publication repeats only the previous one's records, so the stream
owns a monitor thread that reads them well within two publication intervals, whether or not
anyone is looking, and hands each new one to its listeners (the dashboard, the hang
watchdog, the trackers). When the run ends, it waits for the finished ranks' last
publications, reads once more and tells the listeners which ranks failed.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster.waiting import describe_error
from axon_nb.errors import AxonError
from axon_nb.train.publications import MetricsListener, Publications

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

MONITOR_S = 0.1
"""How often the kernel-side monitor thread reads the ranks' metrics stream."""
LAST_PUBLICATION_S = 10.0
"""Once a rank's result is in, how long its last publication (its final status) may trail it:
the publication goes out on the engine's IOPub thread, the result on its shell socket."""
FINAL_STATUSES = ("finished", "stopped", "failed")
"""A rank's status in its last publication of a run (``axon_nb.metrics/1``)."""


class RunStream:
    """The metrics stream of the run behind ``ar`` on ``targets``, and the monitor thread
    that reads it.

    Example::

        stream = RunStream(cluster, ar, [0, 1], run_id)
        stream.add_listener(dashboard)
        stream.start()                 # the monitor thread: reads until the run ends
        stream.history()[-1]["loss"]   # the steps streamed so far
    """

    def __init__(
        self, cluster: ClusterLike, ar: ipp.AsyncResult, targets: list[int], run: str
    ) -> None:
        self._cluster = cluster
        self._client = cluster.client
        """The client the run went out on: once the cluster stops or restarts, its results
        never come, and the monitor ends."""
        self._ar = ar
        self._targets = targets
        self._run = run
        self._parts: dict[int, ipp.AsyncResult] = dict(zip(targets, ar.split(), strict=True))
        self._book = Publications(targets)
        self._lock = threading.Lock()
        self._failed = threading.Event()
        """Set by :meth:`abandon`: the monitor stops, even with ranks still running."""
        self._handed_over = False
        """Set by :meth:`hand_over`: the run goes on in another stream (a resize), so its end
        is not the listeners' end."""
        self._monitor = threading.Thread(target=self._watch, name="axon-train-monitor", daemon=True)

    # --- what the handle asks ---

    def start(self) -> None:
        """Start the monitor thread (once the first listeners are in)."""
        self._monitor.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the monitor's last read and the listeners' ``done``."""
        self._monitor.join(timeout=timeout)

    def abandon(self) -> None:
        """Stop reading although ranks may still run: a rank failed, and results that may
        never come are not waited for (recovery restarts them all, or one is stuck)."""
        self._failed.set()

    def hand_over(self) -> list[MetricsListener]:
        """The run goes on in another stream (``cluster.resize`` stopped it to go on in a new
        world): the listeners get what this one still reads, but not its end. They are
        returned, for the next stream."""
        with self._lock:
            self._handed_over = True
            return list(self._book.listeners)

    def reads(self, client: ipp.Client) -> bool:
        """Whether this is a run of ``client``'s ranks (not of ranks a restart replaced)."""
        return self._client is client

    def take_back(self) -> None:
        """Undo :meth:`hand_over` (the run does not go on after all): the listeners get its
        end, now if it has ended."""
        with self._lock:
            self._handed_over = False
        self._monitor.join(timeout=LAST_PUBLICATION_S + MONITOR_S * 50)
        with self._lock:
            if self._book.ended is None:
                self._book.end(self._failures())

    def poll(self) -> None:
        """Read what the ranks have published since the last poll."""
        with self._lock:
            self._read()

    def history(self) -> list[dict[str, Any]]:
        """Steps streamed so far, in :class:`TrainResult`'s ``history`` format."""
        self.poll()
        with self._lock:
            return self._book.history()

    def latest(self) -> dict[int, dict[str, Any]]:
        """Each rank's latest publication without its records (status, step, memory, ...)."""
        self.poll()
        with self._lock:
            return dict(self._book.latest)

    def progress(self) -> tuple[int, float | None] | None:
        """Steps every rank has done in this run and the first target's last loss (None
        until every rank has published)::

        stream.progress()  # (40, 0.52)
        """
        with self._lock:
            return self._book.progress()

    def add_listener(self, listener: MetricsListener) -> None:
        """Send every new publication, and the run's end, to ``listener`` (a dashboard)."""
        with self._lock:
            self._book.add_listener(listener)

    def summaries(self) -> list[dict[str, Any]]:
        """What each rank that finished returned (rank order, once the run is done)."""
        parts = sorted(self._parts.items())
        return [part.get() for _, part in parts if part.ready() and part.successful()]

    # --- the monitor thread ---

    def _cluster_gone(self) -> bool:
        """The ranks the run went to are gone (the cluster stopped or restarted)."""
        try:
            return not self._cluster.running or self._cluster.client is not self._client
        except AxonError:  # stopping just now: its client is gone before its ranks
            return True

    def _watch(self) -> None:
        while not self._ar.ready() and not self._failed.is_set() and not self._cluster_gone():
            with self._lock:
                self._read()
                self._book.tick()
            time.sleep(MONITOR_S)
        self._wait_for_last_publications()
        self.poll()
        failures = self._failures()
        with self._lock:
            if not self._handed_over:
                self._book.end(failures)

    def _failures(self) -> dict[int, str]:
        failures = {
            rank: "{}: {}".format(*describe_error(part.exception()))
            for rank, part in self._parts.items()
            if part.ready() and not part.successful()
        }
        if not self._ar.ready() and self._cluster_gone():
            gone = "the cluster stopped or restarted"
            failures.update({r: gone for r, p in self._parts.items() if not p.ready()})
        return failures

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
            with self._lock:
                self._read()
                final = all(
                    self._book.latest.get(r, {}).get("status") in FINAL_STATUSES for r in finished
                )
            if final or all(p.wait_for_output(0) for p in finished.values()):
                return
            if self._cluster_gone():  # (what has not come will not)
                return
            time.sleep(MONITOR_S / 5)

    def _read(self) -> None:
        """Hand each rank's new publication to the listeners (with the lock held)."""
        for rank, part in self._parts.items():
            data = part.data
            if isinstance(data, list):  # single-target results may still wrap in a list
                data = data[0] if data else {}
            if not data or data.get("run") != self._run:
                continue
            previous = self._book.latest.get(rank)
            if previous is not None and previous["heartbeat"] == data["heartbeat"]:
                continue  # nothing new from this rank
            self._book.take(rank, data)
