"""The messages a :class:`~axon_nb.train.tracking.Tracker` queues for its thread.

The kernel's thread (``follow``, ``end``) and the run's monitor thread (each publication,
the run's end) put them on one queue; the tracking thread takes them in order and dispatches
on their type. Each carries ``follow``, the number of the :meth:`Tracker.follow
<axon_nb.train.tracking.Tracker.follow>` it belongs to, so that what a replaced run still
sends after a restart is left out. Example::

    queue.put(Begin(follow=1, world_size=2))
    queue.put(Publication(1, {"rank": 0, "step": 3, "records": [...]}))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from axon_nb.train.run_stream import MetricsListener


@dataclass(frozen=True, slots=True)
class Begin:
    """A run to follow begins: the ``follow``-th of the tracked run (a restart adds one)."""

    follow: int
    world_size: int
    """The ranks of the run, each of whose records a step waits for."""


@dataclass(frozen=True, slots=True)
class Publication:
    """One publication of a rank (schema ``axon_nb.metrics/1``, with its ``rank``)."""

    follow: int
    message: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RunDone:
    """The followed run ended: what the ranks that finished returned, and who failed."""

    follow: int
    failures: dict[int, str]
    summaries: list[dict[str, Any]]
    last: bool
    """Its end ends the tracked run (else :class:`End` does, after a restart or compare)."""


@dataclass(frozen=True, slots=True)
class Resized:
    """The followed run goes on in a world of ``world_size`` ranks (``cluster.resize``): the
    steps of the old world are complete, and a step now waits for this many ranks."""

    follow: int
    world_size: int


@dataclass(frozen=True, slots=True)
class End:
    """End the tracked run and close the trackers with ``status`` (MLflow's run status)."""

    follow: int
    status: str


Message = Begin | Publication | RunDone | Resized | End
"""What the tracking thread's queue holds; each carries the follow it belongs to."""


class Followed(Protocol):
    """What :meth:`Tracker.follow` needs of a run's handle (a ``TrainHandle`` has it)."""

    def add_listener(self, listener: MetricsListener) -> None:
        """Send every publication, and the run's end, to ``listener``."""

    def summaries(self) -> list[dict[str, Any]]:
        """What each rank that finished returned."""
