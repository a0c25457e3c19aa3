"""How far a rank is in a long call (``evaluate``, ``predict``), published to the kernel,
which draws it as a bar (``axon_nb/train/progress.py``).

Published with ipyparallel's ``publish_data`` (``axon_nb/spec/call_progress.py``),
at most every :data:`REPORT_S` and at the end; the kernel reads rank 0's. Example (on a
rank, inside a call from the kernel)::

    for batch in reported(batches, len(batches)):
        ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from axon_nb.spec.call_progress import PROGRESS_KEY

REPORT_S = 0.5
"""A rank publishes its progress at most this often (and once at the end)."""

T = TypeVar("T")


def reported(
    items: Iterable[T], total: int, loss: Callable[[], float | None] = lambda: None
) -> Iterator[T]:
    """Yield ``items``, publishing how many were done of ``total`` (and ``loss()``)."""
    from ipyparallel.datapub import publish_data

    last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= REPORT_S or done == total:
            last = now
            publish_data({PROGRESS_KEY: (done, total, loss())})
