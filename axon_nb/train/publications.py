"""``Publications``: what the ranks of one run have published, as the kernel collected it, and
the listeners it is handed to. Both ways of reading a run keep one: ``RunStream`` (ipyparallel's
data publications, for the kernel's own runs) and ``KeptHandle`` (the files a detached
cluster's or a job's ranks keep).

Not locked itself: its owner holds its own lock around every call.

Example::

    book = Publications([0, 1])
    book.add_listener(dashboard)     # told of everything so far, then of each new one
    book.take(0, message)            # a publication of rank 0 (schema axon_nb.metrics/1)
    book.history()[-1]["loss"]
"""

from __future__ import annotations

from typing import Any, Protocol

from axon_nb.train.result import merge_records


class MetricsListener(Protocol):
    """Receives the metrics stream of one run (called from the monitor thread)."""

    def message(self, rank: int, message: dict[str, Any]) -> None:
        """One publication of ``rank`` (schema ``axon_nb.metrics/1``)."""

    def tick(self) -> None:
        """Called on every monitor poll (about ``MONITOR_S``), messages or not."""

    def done(self, failures: dict[int, str]) -> None:
        """The run ended; ``failures`` maps failed ranks to their error."""


class Publications:
    """The publications of ``targets``: each rank's latest and every step record."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.records: dict[int, dict[int, dict[str, Any]]] = {r: {} for r in targets}
        """Each rank's step records by step (a later publication's record of a step wins)."""
        self.latest: dict[int, dict[str, Any]] = {}
        """Each rank's latest publication without its records (status, step, memory, ...)."""
        self.listeners: list[MetricsListener] = []
        self.ended: dict[int, str] | None = None
        """The failures the listeners were told of at the run's end (None while it runs)."""

    def take(self, rank: int, message: dict[str, Any]) -> None:
        """A new publication of ``rank``: kept, and handed to every listener."""
        self.latest[rank] = {k: v for k, v in message.items() if k != "records"}
        for listener in self.listeners:
            listener.message(rank, message)
        for record in message.get("records", ()):
            self.records[rank][record["step"]] = record

    def add_listener(self, listener: MetricsListener) -> None:
        """Tell ``listener`` of everything so far (and of the end, if it came), then of what
        comes."""
        self.listeners.append(listener)
        for rank, message in self.latest.items():  # catch up on what came before
            listener.message(rank, {**message, "records": list(self.records[rank].values())})
        if self.ended is not None:
            listener.done(self.ended)

    def tick(self) -> None:
        for listener in self.listeners:
            listener.tick()

    def end(self, failures: dict[int, str]) -> None:
        """The run ended; ``failures`` maps failed ranks to their error."""
        self.ended = failures
        for listener in self.listeners:
            listener.done(failures)

    def history(self) -> list[dict[str, Any]]:
        """Steps so far, in :class:`TrainResult`'s ``history`` format."""
        return merge_records(self.records)

    def progress(self) -> tuple[int, float | None] | None:
        """Steps every rank has done in the run (from each one's latest publication) and
        the first target's last loss; None until every rank has published."""
        if len(self.latest) < len(self.targets):
            return None
        done = min(m["step"] - m["start_step"] for m in self.latest.values())
        first = self.records[self.targets[0]]
        return done, first[max(first)]["loss"] if first else None
