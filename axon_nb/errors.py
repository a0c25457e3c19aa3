"""Errors a user sees, each saying what went wrong and what to do next."""

from __future__ import annotations


class AxonError(RuntimeError):
    """Base class of axon_nb's errors."""


class NoClusterError(AxonError):
    """An operation needs a running cluster and there is none."""


class ClusterStartError(AxonError):
    """The cluster could not be started; nothing was left running."""


class ClusterBrokenError(AxonError):
    """A rank died earlier; the world must be restarted before it can be used again."""


class RankError(AxonError):
    """Code raised on one or more ranks.

    ``rank`` is the rank that failed first (the cause; others usually fail because of it),
    whose remote traceback ``traceback`` holds; ``failed_ranks`` lists every failed rank.
    ``running`` says where the ranks that had not finished were when it failed (for a
    collective timeout: who was elsewhere), one line per place; empty when all had finished.
    """

    def __init__(
        self,
        rank: int,
        ename: str,
        evalue: str,
        traceback: str,
        failed_ranks: list[int],
        running: str = "",
    ) -> None:
        self.rank = rank
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback
        self.failed_ranks = failed_ranks
        self.running = running
        super().__init__(self._headline())

    def _headline(self) -> str:
        others = [r for r in self.failed_ranks if r != self.rank]
        also = f" (then ranks {', '.join(map(str, others))} failed too)" if others else ""
        headline = f"rank {self.rank} raised {self.ename}: {self.evalue.rstrip()}{also}"
        if self.running:
            headline += "\nWhere the other ranks were when it failed:\n" + "\n".join(
                f"  {line}" for line in self.running.splitlines()
            )
        return headline

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the kernel-side stack, which says nothing useful."""
        lines = [f"[rank {self.rank}] {line}" for line in self.traceback.rstrip().splitlines()]
        return [*lines, f"{type(self).__name__}: {self._headline()}"]


class RankDiedError(RankError):
    """A rank's process died while running code; the cluster needs a restart."""

    log = ""
    """The end of the cluster's log (the engines' output) and where all of it is."""
    when = "while running"
    """When it died: "while running" (a call), "between calls" (found at the next one)."""

    def with_log(self, log: str) -> RankDiedError:
        """This error, its message ending with ``log`` (what the rank printed last)."""
        self.log = log
        self.args = (self._headline(),)
        return self

    def _headline(self) -> str:
        headline = (
            f"rank {self.rank} died {self.when} ({self.evalue}). The world is broken: "
            "run `%axon_cluster --restart` (or `cluster.restart()`) to start fresh ranks; "
            "first, `cluster.rescue(path)` saves what the surviving ranks hold"
        )
        return f"{headline}\n{self.log}" if self.log else headline

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self._headline()}"]
