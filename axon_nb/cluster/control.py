"""Signals and releases ranks on behalf of the waiting loop (see ``waiting.RankControl``)."""

from __future__ import annotations

import signal
import sys

import ipyparallel as ipp

from axon_nb.rank import entry


class Control:
    """Interrupts ranks (SIGINT through their nannies) and releases ranks stuck in a
    collective their peers have left; ``released`` records that the world must be re-formed."""

    def __init__(self, client: ipp.Client, world_ranks: list[int]) -> None:
        self.client = client
        self.world_ranks = world_ranks
        self.released = False

    def interrupt(self, ranks: list[int]) -> None:
        if not ranks:
            return
        try:  # through the engines' nannies, so it works for any launcher and host
            self.client.send_signal(signal.SIGINT, targets=ranks, block=True)
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
