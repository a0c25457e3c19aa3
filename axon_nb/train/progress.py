"""A text progress bar for long calls on the cluster (``train`` without its dashboard,
``evaluate``, ``predict``, ``compare``): steps done of those asked, elapsed time, time left
and the last loss, redrawn in place with ``\\r``.

It draws where ``\\r`` redraws a line: a terminal, or a Jupyter kernel (whose front end
applies ``\\r`` to the cell's stdout). Where output goes to a file or a pipe, it draws
nothing: a log gets no hundred copies of a bar. In the notebook, ``train`` shows the same
figures in its dashboard instead. Example::

    bar = ProgressBar("evaluate", total=40)
    bar.update(10, loss=0.52)
    # evaluate  25%|█████               | 10/40 [00:03<00:09, loss 0.52]
    bar.close()
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

import ipyparallel as ipp

from axon_nb.spec.call_progress import PROGRESS_KEY
from axon_nb.widgets.frontend import in_notebook

if TYPE_CHECKING:
    from axon_nb.cluster.transport import Sent

WIDTH = 20
"""Characters of the bar itself."""
REDRAW_S = 0.2
"""The bar is redrawn at most this often (and at the end)."""


def draws_on(file: TextIO) -> bool:
    """Whether a bar drawn to ``file`` redraws in place: a terminal or a Jupyter kernel."""
    if file in (sys.stdout, sys.__stdout__) and in_notebook():
        return True
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # (closed)
        return False


class ProgressBar:
    """Steps done of ``total``, elapsed, time left and the last loss, on one line.

    ``file`` defaults to stdout; nothing is drawn unless :func:`draws_on` it."""

    def __init__(self, label: str, total: int, *, file: TextIO | None = None) -> None:
        self.label, self.total = label, max(0, int(total))
        self.file = file if file is not None else sys.stdout
        self.enabled = draws_on(self.file)
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._done = 0
        self._loss: float | None = None
        self._closed = False

    def update(self, done: int, *, total: int | None = None, loss: float | None = None) -> None:
        """Steps done so far (of ``total``, if it changed), and the newest loss if any."""
        if total is not None:
            self.total = max(0, int(total))
        self._done = max(0, min(int(done), self.total))
        if loss is not None:
            self._loss = float(loss)
        now = time.monotonic()
        due = now - self._drawn_at >= REDRAW_S
        if self.enabled and self.total and not self._closed and due:
            self._draw(now)

    def close(self) -> None:
        """Draw the last state and end the line (once)."""
        if self.enabled and self.total and not self._closed:
            self._draw(time.monotonic())
            self.file.write("\n")
            self.file.flush()
        self._closed = True

    def line(self, now: float | None = None) -> str:
        """The bar's text as it would be drawn now."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._started
        share = self._done / self.total if self.total else 1.0
        filled = int(share * WIDTH)
        bar = "█" * filled + " " * (WIDTH - filled)
        left = elapsed * (self.total - self._done) / self._done if self._done else None
        loss = "" if self._loss is None else f", loss {self._loss:.4g}"
        return (
            f"{self.label} {share:4.0%}|{bar}| {self._done}/{self.total} "
            f"[{clock(elapsed)}<{clock(left)}{loss}]"
        )

    def _draw(self, now: float) -> None:
        self._drawn_at = now
        self.file.write("\r" + self.line(now))
        self.file.flush()


def clock(seconds: float | None) -> str:
    """``mm:ss`` (``h:mm:ss`` past an hour); ``?`` when unknown."""
    if seconds is None:
        return "?"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def wait_with_bar(sent: Sent, label: str) -> list[Any]:
    """Wait for a call whose ranks publish their progress (``rank/observe/call_progress.py``)
    and return its results in rank order, drawing its bar meanwhile. Example::

        wait_with_bar(cluster.send(entry.evaluate, ...), "evaluate")[0]
    """
    bar, tick = published(label, sent.ar)
    try:
        return sent.wait(tick=tick)
    finally:
        tick()
        bar.close()


def published(label: str, ar: ipp.AsyncResult) -> tuple[ProgressBar, Callable[[], None]]:
    """A bar for a call whose ranks publish their progress, and the ``tick`` that redraws
    it from rank 0's (see :func:`wait_with_bar`)."""
    bar = ProgressBar(label, 0)

    def tick() -> None:
        data = ar.data
        first = data[0] if isinstance(data, list) else data
        if isinstance(first, dict) and PROGRESS_KEY in first:
            done, total, loss = first[PROGRESS_KEY]
            bar.update(done, total=total, loss=loss)

    return bar, tick
