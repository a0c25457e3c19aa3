"""``Dashboard``: one live widget per training run (progress, training and evaluation loss,
memory, communication, status).

Built on anywidget: a handful of synced traits plus a small bundled chart script
(``_dashboard.js``, plain SVG, no third-party chart library). Updates are throttled to
``UPDATE_S`` and incremental: new loss and evaluation points travel as an ``append`` message;
the whole series (thinned to at most ``2 x MAX_POINTS`` points) is re-synced only every
``FULL_SYNC_S`` and when the run ends, so a re-displayed widget still has it. ``save`` writes
a self-contained page drawn here in Python (``export.py``), not the widget.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from axon_nb.widgets._state import DashboardState

UPDATE_S = 0.5
"""At most one widget update per this many seconds, whatever the step rate."""
IDLE_REFRESH_S = 2.0
"""Without publications, refresh this often anyway (statuses, the stalled check)."""
FULL_SYNC_S = 5.0
"""How often the whole loss series is re-synced (between, only new points are sent)."""


class Dashboard(anywidget.AnyWidget):
    """The live view of one run; ``cluster.train`` shows it, ``save`` exports it.

    Example::

        handle = cluster.train(..., block=False)
        handle.dashboard                 # displays the widget in the notebook
        handle.wait().dashboard.save("run.html")
    """

    _esm = Path(__file__).with_name("_dashboard.js")
    _css = Path(__file__).with_name("_dashboard.css")

    title = traitlets.Unicode("").tag(sync=True)
    progress = traitlets.Dict().tag(sync=True)
    ranks: traitlets.List[Any] = traitlets.List().tag(sync=True)
    memory: traitlets.List[Any] = traitlets.List().tag(sync=True)
    communication: traitlets.List[Any] = traitlets.List().tag(sync=True)
    experts = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    loss = traitlets.Dict().tag(sync=True)
    layout_changes: traitlets.List[Any] = traitlets.List().tag(sync=True)
    """Each move of the run to another strategy (``step``, ``from``, ``to``, ``seconds``): a
    labelled vertical marker on the loss chart at its step."""
    frozen = traitlets.Bool(False).tag(sync=True)
    hang_report = traitlets.Unicode("").tag(sync=True)
    """Where the ranks were when the run stopped making progress (empty while it makes some)."""
    trace_summary: traitlets.List[Any] = traitlets.List().tag(sync=True)
    """With ``trace=``: per rank (rank order), its trace's summary (``top_ops`` as ``(name,
    self_ms)`` pairs, ``compute_ms``, ``comm_ms``, ``comm_share``, ...) or None; set once the
    run ends (``dashboard.trace_summary = result.traces``), and ``save`` shows it too."""

    def __init__(self, world_size: int, *, title: str = "", **kwargs: Any) -> None:
        super().__init__(title=title, **kwargs)
        self.state = DashboardState(world_size)
        self.updates = 0
        """Widget updates sent so far (throttling keeps this small)."""
        self._lock = threading.Lock()
        self._last_update = float("-inf")
        self._last_full = float("-inf")
        self._refresh(full=True)

    # -- MetricsListener -------------------------------------------------------------------

    def message(self, rank: int, message: dict[str, Any]) -> None:
        """Take one publication; the widget updates at most every ``UPDATE_S``."""
        with self._lock:
            self.state.update(rank, message)
            if time.monotonic() - self._last_update >= UPDATE_S:
                self._refresh(full=time.monotonic() - self._last_full >= FULL_SYNC_S)

    def tick(self) -> None:
        """Refresh now and then without news, so a silent rank turns "stalled"."""
        with self._lock:
            if time.monotonic() - self._last_update >= IDLE_REFRESH_S:
                self._refresh(full=False)

    def done(self, failures: dict[int, str]) -> None:
        """The run ended: mark failed ranks, freeze, and sync the final state."""
        with self._lock:
            for rank, error in failures.items():
                if self.state.status(rank) != "failed":
                    self.state.fail(rank, error)
            self.state.freeze()
            self._refresh(full=True)

    def note(self, text: str) -> None:
        """Show an event of the run (a restart, say) beside its progress."""
        with self._lock:
            self.state.notes.append(text)
            self._refresh(full=False)

    def resized(self, old: int, new: int, step: int) -> None:
        """The run went on in a world of ``new`` ranks from ``step`` (``cluster.resize``):
        the ranks that left stay as rows marked so, the new ones join, the run goes on."""
        with self._lock:
            self.state.resize(old, new, step)
            self._refresh(full=True)

    def show_hang(self, report: str) -> None:
        """Show a hang report (``%axon_cluster --hang-timeout``); ``""`` clears it."""
        with self._lock:
            self.hang_report = report

    @traitlets.observe("trace_summary")
    def _trace_changed(self, change: dict[str, Any]) -> None:
        self.state.trace_summary = list(change["new"])

    # -- export ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write one self-contained HTML page of the run and return its path.

        The charts (training and evaluation loss, per-rank loss, memory and communication per
        rank) are inline SVG, statuses and the trace summary tables: no script, no network, so
        the page reads the same with JavaScript off or on an air-gapped machine.

        Example::

            result.dashboard.save("run.html")
        """
        from axon_nb.widgets.export import render_html

        with self._lock:
            snapshot = self.state.snapshot()
            page = render_html(
                snapshot, title=self.title or "axon_nb run", hang_report=self.hang_report
            )
        path = Path(path)
        path.write_text(page, encoding="utf-8")
        return path

    # -- internals -------------------------------------------------------------------------

    def _refresh(self, *, full: bool) -> None:
        snapshot = self.state.snapshot()
        points = self.state.take_new_points()
        evals = self.state.take_new_evals()
        with self.hold_sync():
            self.progress = snapshot["progress"]
            self.ranks = snapshot["ranks"]
            self.memory = snapshot["memory"]
            self.communication = snapshot["comm"]
            self.experts = snapshot["experts"]
            self.frozen = snapshot["frozen"]
            self.layout_changes = snapshot["layout_changes"]
            if full:
                self.loss = snapshot["loss"]
        if (points or evals) and not full:
            self.send({"type": "append", "points": points, "evals": evals})
        now = time.monotonic()
        self._last_update = now
        if full:
            self._last_full = now
        self.updates += 1
