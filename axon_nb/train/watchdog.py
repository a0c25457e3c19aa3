"""``HangWatchdog``: notices when a training run stops making steps, and reports where.

It listens to a run's metrics stream (``train/run_stream.py``) like the dashboard does: each
publication brings the rank's step, and on every monitor poll the watchdog checks them with
a :class:`~axon_nb.cluster.hangs.HangWatch`. Once no rank finished a step for the cluster's
``hang_timeout`` (``%axon_cluster N --hang-timeout S``), it asks the ranks for their stacks
and shows the report; the report is cleared when steps come again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from axon_nb.cluster.hangs import HangWatch

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

Steps = tuple[tuple[int, int], ...]
"""Each rank's latest step, as ``(rank, step)`` pairs in rank order."""


class HangWatchdog:
    """A :class:`~axon_nb.train.run_stream.MetricsListener` that reports a run without steps.

    ``show`` is given the report (``""`` clears it); ``running`` says whether the run is
    still going (a report that comes after its end is not shown). Example::

        watchdog = HangWatchdog(cluster, 300, show=dashboard.show_hang, running=lambda: True)
        stream.add_listener(watchdog)
    """

    def __init__(
        self,
        cluster: ClusterLike,
        timeout_s: float,
        *,
        show: Callable[[str], None],
        running: Callable[[], bool],
    ) -> None:
        self._cluster = cluster
        self._show = show
        self._running = running
        self._watch = HangWatch(timeout_s, self._on_hang)
        self._latest: dict[int, int] = {}
        self._steps: Steps = ()
        """A snapshot of ``_latest``, read by the report thread."""
        self._hang_at: Steps | None = None
        """The steps when a hang was last reported (the report stays until they change)."""

    # --- MetricsListener (called from the stream's monitor thread) ---

    def message(self, rank: int, message: dict[str, Any]) -> None:
        """Note the rank's step."""
        self._latest[rank] = message["step"]
        self._steps = tuple(sorted(self._latest.items()))

    def tick(self) -> None:
        """Report once when no rank finished a step for ``timeout_s``."""
        self._clear()
        self._watch.check(self._steps)

    def done(self, failures: dict[int, str]) -> None:
        """The run ended: clear a report that steps since came after."""
        self._clear()

    # --- the report ---

    def _clear(self) -> None:
        if self._hang_at is not None and self._steps != self._hang_at:
            self._hang_at = None
            self._show("")  # moving again

    def _on_hang(self, seconds: float) -> None:
        # In its own thread: taking the stacks may take seconds, and the monitor must keep
        # reading the stream meanwhile (a publication repeats only the previous one's records).
        self._hang_at = self._steps
        threading.Thread(
            target=self._report, args=(seconds,), name="axon-hang-report", daemon=True
        ).start()

    def _report(self, seconds: float) -> None:
        report = self._cluster.report_hang(seconds, progress="no rank finished a step")
        if report is not None and self._running() and self._hang_at == self._steps:
            self._show(f"No step for {seconds:.0f} s. {report.format()}")
