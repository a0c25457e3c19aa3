"""Measure the collectives a rank really issues: kind, payload bytes and time.

While a :class:`CommMeter` is installed, the one interposer (``collective.py``, which wraps the
``torch.distributed`` collectives and the functional collectives of
``torch.distributed._functional_collectives`` that DTensor redistributes with) reports every
call to it. PyTorch's DDP comm
hooks, FSDP2, ZeroRedundancyOptimizer, pipelining and DTensor all call them through their
modules, so their traffic is counted as it happens, not from a formula.

What the figures mean:

- ``bytes`` and ``count``: the payload this rank hands to the collective (its input tensor,
  or the list's total; for ``all_gather`` the input shard, for ``recv`` the receive buffer),
  counted as soon as the call returns, so a step's figures hold every collective it started,
  whether or not it has finished (the loop's agreement of a step finishes during the next).
- ``time_s``: wall time from the call until its result is ready, counted when it is ready.
  For ``async_op=True`` calls (DDP's buckets) that is until the work's future completes, so it
  includes time queued behind earlier buckets and overlaps backward compute. Functional
  collectives return before their result is waited for: their time is the launch only.
- Code compiled by ``torch.compile`` calls the collective ops directly: not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from axon_nb.metrics import collective
from axon_nb.metrics.payload import FUNCTIONAL, KINDS, PAYLOAD, Payload

__all__ = ["FUNCTIONAL", "KINDS", "PAYLOAD", "CommMeter", "Payload"]


class CommMeter:
    """Accumulates per-kind bytes, time and call count until :meth:`take` is called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}
        self._lifetime: dict[str, list[float]] = {}

    def launched(self, kind: str, nbytes: int) -> None:
        """Count one collective's call and payload, once it has been started."""
        with self._lock:
            for table in (self._totals, self._lifetime):
                row = table.setdefault(kind, [0, 0.0, 0])
                row[0] += nbytes
                row[2] += 1

    def finished(self, kind: str, seconds: float) -> None:
        """Add the time a collective took once its result is ready (called from gloo/NCCL
        completion threads too)."""
        with self._lock:
            for table in (self._totals, self._lifetime):
                table.setdefault(kind, [0, 0.0, 0])[1] += seconds

    def take(self) -> dict[str, dict[str, float]]:
        """Figures since the last ``take`` as ``{kind: {bytes, time_s, count}}``; resets them."""
        with self._lock:
            taken, self._totals = self._totals, {}
        return _as_dicts(taken)

    def totals(self) -> dict[str, dict[str, float]]:
        """Figures since the meter was created."""
        with self._lock:
            return _as_dicts(self._lifetime)

    @contextmanager
    def installed(self) -> Iterator[CommMeter]:
        """Measure the collectives called during the block (``collective.py`` is the one
        interposer: it reports to this meter while it is installed)."""
        collective.install()
        previous = collective.set_meter(self)
        try:
            yield self
        finally:
            collective.set_meter(previous)


def _as_dicts(table: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        kind: {"bytes": int(row[0]), "time_s": row[1], "count": int(row[2])}
        for kind, row in table.items()
    }
