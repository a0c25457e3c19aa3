"""Relayed work runs on each rank in the order the kernel sent it.

Two calls to one rank can reach it by different ways: each goes through the host's leader
for its own call (its lowest target rank), so ``send(f, ranks=[1])`` comes through rank 1's
own engine while a following call to every rank comes through rank 0, and the second can
arrive first (seen under load, and every time when rank 1 is still busy: its engine reads
its socket before its next ipyparallel request). So the kernel numbers the parts it sends to
each rank (``seq``, from 1, per relay ``epoch``: one client's relay) and each rank runs them
in that order, holding a part that came early until the ones before it are in.

A part that never comes (its leader died, or failed while passing the work on) would hold
the rest for ever: the kernel, which sees the leader's failure, says which numbers to
``skip``; a skipped part that comes after all is dropped (the kernel settled it already).

    order = Order()
    order.admit("e1", 2, "B")    # []: part 1 is not in yet
    order.admit("e1", 1, "A")    # ["A", "B"]
    order.skip("e1", [3])        # []   (and part 3 is dropped if it comes)
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Order(Generic[T]):
    """The parts each relay epoch has sent this rank: the next one to run, and those held."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, list[T]]] = {}
        """Parts in ahead of their turn, each as a list of itself (empty: skipped)."""

    def admit(self, epoch: str, seq: int, part: T) -> list[T]:
        """``part`` (number ``seq``) has come: the parts now ready to run, in order."""
        if seq < self._next.setdefault(epoch, 1):
            return []  # (skipped before it came)
        self._held.setdefault(epoch, {}).setdefault(seq, [part])
        return self._release(epoch)

    def skip(self, epoch: str, seqs: list[int]) -> list[T]:
        """Parts ``seqs`` will not be run (their leader failed): those now ready, in order."""
        held = self._held.setdefault(epoch, {})
        first = self._next.setdefault(epoch, 1)
        for seq in seqs:
            if seq >= first:
                held[seq] = []
        return self._release(epoch)

    def waiting(self, epoch: str) -> int:
        """How many parts of ``epoch`` are held (for tests and stack reports)."""
        return len(self._held.get(epoch, {}))

    def _release(self, epoch: str) -> list[T]:
        held = self._held[epoch]
        ready: list[T] = []
        while self._next[epoch] in held:
            ready.extend(held.pop(self._next[epoch]))
            self._next[epoch] += 1
        return ready
