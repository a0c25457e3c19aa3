"""Signals and releases ranks on behalf of the waiting loop (see ``waiting.RankControl``)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import ipyparallel as ipp

from axon_nb.rank import entry

if TYPE_CHECKING:
    from axon_nb.cluster.stacks import StackReport


class Control:
    """Interrupts ranks (SIGINT through their nannies), releases ranks stuck in a collective
    their peers have left (``released`` records that the world must be re-formed), and says
    where ranks are (with ``stacks``, ``Cluster.stacks``)."""

    def __init__(
        self,
        client: ipp.Client,
        world_ranks: list[int],
        stacks: Callable[[list[int]], StackReport] | None = None,
    ) -> None:
        self.client = client
        self.world_ranks = world_ranks
        self.stacks = stacks
        self.released = False

    def where(self, ranks: list[int]) -> str:
        if self.stacks is None or not ranks:
            return ""
        try:
            return "\n".join(self.stacks(ranks).lines())
        except Exception as e:  # a diagnosis only: never let it hide the failure itself
            return f"(their stacks could not be taken: {e})"

    def interrupt(self, ranks: list[int]) -> None:
        self.signal(ranks, signal.SIGINT)

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (SIGUSR1: ``faulthandler`` dumps their stacks)."""
        if not ranks:
            return
        try:  # through the engines' nannies, so it works for any launcher and host
            self.client.send_signal(sig, targets=ranks, block=True)
        except Exception as e:  # a dead engine cannot be signalled; the waiting loop says so
            print(f"could not signal ranks {ranks}: {e}", file=sys.stderr)

    def release(self, stuck: list[int]) -> None:
        free = [r for r in self.world_ranks if r not in stuck]
        if not free or not stuck:
            return
        self.released = True
        try:
            self.client[free].apply_async(entry.sever).get(timeout=10)
        except Exception as e:
            print(f"could not release ranks {stuck}: {e}", file=sys.stderr)
