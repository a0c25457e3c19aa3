"""Signals and releases ranks on behalf of the waiting loop (see ``waiting.RankControl``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster.sending import dispatch
from axon_nb.rank import entry

if TYPE_CHECKING:
    from axon_nb.cluster.stacks import StackReport


SIGNAL_REPLY_S = 10.0
"""How long the ranks' nannies get to confirm a signal before the kernel goes on without
their answer (ipyparallel's blocking ``send_signal`` waits for it for ever)."""


ABORT_REPLY_S = 2.0
"""How long the engines get to note an abort before the SIGINT that follows it is sent (an
abort's reply takes about 10-30 ms here, under a load of 12 busy processes on 2 cores too)."""


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
        self.interrupted_at: float | None = None
        """When :meth:`interrupt` last sent SIGINT (``time.monotonic()``)."""

    def where(self, ranks: list[int]) -> str:
        if self.stacks is None or not ranks:
            return ""
        try:
            return "\n".join(self.stacks(ranks).lines())
        except Exception as e:  # a diagnosis only: never let it hide the failure itself
            return f"(their stacks could not be taken: {e})"

    def interrupt(self, ranks: list[int]) -> None:
        at = time.monotonic()
        if self.signal(ranks, signal.SIGINT):
            self.interrupted_at = at

    def abort(self, work: dict[int, list[str]]) -> None:
        """Each rank in ``work`` skips its messages there if it has not started them yet
        (ipyparallel's abort): a SIGINT that reaches a rank before it starts the work (still
        busy with an earlier request, or under load) ends nothing of it, and the rank would
        then run it unstopped. Waits up to ``ABORT_REPLY_S`` for the engines to note it."""
        alive = set(self.client.ids)
        try:  # (an empty list would make ipyparallel abort everything queued on the engine)
            sent = [
                self.client.abort(ids, [r], False) for r, ids in work.items() if ids and r in alive
            ]
        except Exception as e:  # (a rank dropped meanwhile) the SIGINT still goes
            print(f"could not send the abort to ranks {sorted(work)}: {e}", file=sys.stderr)
            return
        # A rank that does not answer in time (its GIL held in native code) still gets the
        # SIGINT; not waiting for it is no failure worth a word.
        concurrent.futures.wait(sent, timeout=ABORT_REPLY_S)

    def signal(self, ranks: list[int], sig: int) -> bool:
        """Send ``sig`` to ``ranks`` (SIGUSR1: ``faulthandler`` dumps their stacks); ranks whose
        engine the controller has dropped (dead) are skipped. Whether it went out (a nanny
        that did not confirm in time may still have sent it)."""
        alive = set(self.client.ids)
        ranks = [r for r in ranks if r in alive]
        if not ranks:
            return False
        try:  # through the engines' nannies, so it works for any launcher and host
            replies = self.client.send_signal(sig, targets=ranks, block=False)
            failed = [
                m["content"] for m in replies.result(timeout=SIGNAL_REPLY_S)
                if m["content"]["status"] != "ok"
            ]  # fmt: skip
            if failed:
                raise self.client._unwrap_exception(failed[0])
        except concurrent.futures.TimeoutError:  # a silent nanny must not hold up the kernel
            print(
                f"ranks {ranks} did not confirm signal {sig} within {SIGNAL_REPLY_S:.0f} s",
                file=sys.stderr,
            )
        except Exception as e:  # a dead engine cannot be signalled; the waiting loop says so
            print(f"could not signal ranks {ranks}: {e}", file=sys.stderr)
            return False
        return True

    def release(self, stuck: list[int]) -> None:
        alive = set(self.client.ids)  # (a dead rank's engine cannot be asked anything)
        free = [r for r in self.world_ranks if r not in stuck and r in alive]
        if not free or not stuck:
            return
        self._sever(free, f"could not release ranks {stuck}")

    def check_in_step(self) -> None:
        """After an interrupt that every rank unwound from: if ranks issued different numbers
        of collectives on a group (one was stopped just before issuing what its peers issued),
        sever every rank's connections (a stale collective still pending fails) and mark the
        world for re-forming."""
        alive = [r for r in self.world_ranks if r in set(self.client.ids)]
        if len(alive) < 2:
            return
        try:
            counts = dispatch(self.client, alive, entry.collectives_issued).get(timeout=10)
        except Exception as e:  # a diagnosis failing must not hide the interrupt itself
            print(f"could not compare the ranks' collectives: {e}", file=sys.stderr)
            return
        names = {name for issued in counts for name in issued}
        if all(len({issued[n] for issued in counts if n in issued}) == 1 for n in names):
            return
        self._sever(alive, f"could not sever ranks {alive}")

    def _sever(self, ranks: list[int], failure: str) -> None:
        """Cut ``ranks``' connections (``entry.sever``) and mark the world for re-forming."""
        self.released = True
        try:
            dispatch(self.client, ranks, entry.sever).get(timeout=10)
        except Exception as e:
            print(f"{failure}: {e}", file=sys.stderr)


class HeldInterrupt:
    """Whether a Ctrl-C arrived while it was held back (see :func:`held_interrupts`)."""

    arrived = False


@contextlib.contextmanager
def held_interrupts() -> Iterator[HeldInterrupt]:
    """Hold back Ctrl-C while work is being sent to the ranks.

    An interrupt in the middle of sending would leave some ranks with the work and others
    without, waiting for each other in a collective. The held one is delivered by the wait
    that follows (``wait_for_ranks(interrupted=...)``), which forwards it to every rank.
    Example::

        with held_interrupts() as held:
            ar = dispatch(client, targets, fn)
        wait_for_ranks(ar, targets, control=control, interrupted=held.arrived)
    """
    held = HeldInterrupt()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum: int, frame: object) -> None:
        held.arrived = True

    saved = signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, saved)


class WitnessedInterrupt:
    """Whether a Ctrl-C came (see :func:`witnessed_interrupts`)."""

    arrived = False


@contextlib.contextmanager
def witnessed_interrupts() -> Iterator[WitnessedInterrupt]:
    """Note each Ctrl-C that the handler in force turns into ``KeyboardInterrupt``, while
    a wait runs on the main thread.

    Python runs a signal's handler wherever the main thread is: inside a deallocator (pyzmq's
    ``Frame.__dealloc__`` checks for signals), its ``KeyboardInterrupt`` is printed as
    "Exception ignored" and lost, and the wait would go on as if no Ctrl-C came. The wait
    looks at ``arrived`` on each round and raises it then. Nothing is changed where Ctrl-C is
    ignored or left to the system. Example::

        with witnessed_interrupts() as witness:
            while not done():
                if witness.arrived:
                    raise KeyboardInterrupt  # (its own was swallowed)
                ...
    """
    witness = WitnessedInterrupt()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield witness
        return

    def note(signum: int, frame: Any) -> Any:
        try:
            return previous(signum, frame)
        except KeyboardInterrupt:  # (not when that handler held it, or dropped it on purpose)
            witness.arrived = True
            raise

    signal.signal(signal.SIGINT, note)
    try:
        yield witness
    finally:
        signal.signal(signal.SIGINT, previous)
