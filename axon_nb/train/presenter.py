"""``RunPresenter``: what a training run shows in the notebook while it runs and when it ends.

In the notebook that is the run's :class:`~axon_nb.widgets.dashboard.Dashboard`, fed by the
metrics stream (``train/run_stream.py``); where no dashboard is shown (a terminal, a kernel's
``compare``), a text :class:`~axon_nb.train.progress.ProgressBar`. At the end it prints what
the result says beyond its numbers: a reshard, the profiled steps, a stop at a step boundary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from axon_nb.train.progress import ProgressBar
from axon_nb.train.result import TrainResult
from axon_nb.train.trace_report import trace_table
from axon_nb.widgets.dashboard import Dashboard

Progress = Callable[[], tuple[int, float | None] | None]
"""Steps every rank has done and the last loss, or None while not every rank has published
(:meth:`~axon_nb.train.run_stream.RunStream.progress`)."""


class RunPresenter:
    """The dashboard and the text bar of one run, and what is printed at its end.

    Example::

        presenter = RunPresenter(
            "mlp", label="train mlp", steps=100, world_size=2, title="mlp · DDP · 2 ranks"
        )
        stream.add_listener(presenter.dashboard)
        presenter.show()                       # in the notebook: the dashboard, no text bar
        presenter.tick(stream.progress)        # while waiting
        presenter.report(result)               # at the end
    """

    def __init__(self, name: str, *, label: str, steps: int, world_size: int, title: str) -> None:
        self._name = name
        self.shown = False
        """True once the dashboard is displayed (then no text bar is drawn)."""
        self.dashboard = Dashboard(world_size, title=title)
        """The live widget of this run; display it (``%axon_dashboard``) to watch."""
        self._bar = ProgressBar(label, steps)
        """The text bar drawn where no dashboard is shown (a terminal; a kernel's compare)."""

    def show(self) -> None:
        """Display the dashboard in the notebook (what ``%axon_dashboard`` does)."""
        from IPython.display import display

        display(self.dashboard)
        self.shown = True

    def show_hang(self, report: str) -> None:
        """Show a hang report on the dashboard; ``""`` clears it."""
        self.dashboard.show_hang(report)

    def tick(self, progress: Progress) -> None:
        """Redraw the text bar from ``progress()``, where no dashboard is shown."""
        if self.shown:
            return
        now = progress()
        if now is not None:
            done, loss = now
            self._bar.update(done, loss=loss)

    def close(self, progress: Progress) -> None:
        """The run's last state on the text bar, and the end of its line."""
        if not self.shown:
            self.tick(progress)
            self._bar.close()

    def report(self, result: TrainResult) -> None:
        """Hand the dashboard to ``result`` and print what it says beyond its numbers."""
        result.dashboard = self.dashboard
        change = result.layout_change
        if change:
            print(
                f"Resharded {self._name!r} from {change['from']} to {change['to']} in "
                f"{change['seconds']:.1f} s (at step {change['step']})."
            )
        if result.traces:
            print(trace_table(result.traces))
            self.dashboard.trace_summary = result.traces
        if result.preempted:
            said = result.preempted
            print(
                f"Preempted ({said['signal']}) at step {said['step']}: every rank wrote its part "
                f"of a checkpoint to {said['path']}. On a new cluster, train(..., steps=0), "
                f"cluster.load({said['path']!r}) and train(..., resume=True) go on from it.",
                file=sys.stderr,
            )
        elif result.stopped:
            print(
                f"Training stopped at step {result.step} on every rank; "
                f"`{self._name}` is usable on the ranks, and train(..., resume=True) "
                "continues from here.",
                file=sys.stderr,
            )
