"""Waiting, before a stop's SIGINT, until every rank is training.

On a rank a SIGINT is a stop at the next step boundary only once its run has begun
(``rank/world/interrupts.py``: ``StopSignal``). One that comes before, while the rank still
receives the run (the call in transit, or being unpickled), interrupts it there, and the run
fails; or, on an idle engine, it is lost and the run goes on to its end. So ``stop()`` right
after ``cluster.train(..., block=False)`` first waits for each rank's first publication.

Example (what ``TrainHandle.request_stop`` does)::

    wait_until_training(targets, lambda: handle.latest, lambda: handle.done, streams=True)
    cluster.interrupt(targets)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

BEGIN_S = 120.0
"""How long a stop waits for ranks that have not begun (a slow build); then it sends its
SIGINT anyway (a rank still building takes it as a stop too; one still receiving the run is
interrupted)."""

LOOK_S = 0.05


def wait_until_training(
    targets: Collection[int],
    latest: Callable[[], Mapping[int, Any]],
    done: Callable[[], bool],
    *,
    streams: bool,
    limit_s: float = BEGIN_S,
) -> None:
    """Return once each of ``targets`` has published (``latest``: each rank's last
    publication), the run is ``done``, or ``limit_s`` passed. ``streams``: the run publishes
    (``metrics_interval_s > 0``); without, there is nothing to wait for."""
    deadline = time.monotonic() + limit_s
    while streams and not done() and time.monotonic() < deadline:
        if set(targets) <= set(latest()):
            return
        time.sleep(LOOK_S)
