"""Wait for work on the ranks: stream their output, surface the first failure, forward Ctrl-C.

Everything here waits on public ipyparallel AsyncResult state from the kernel's main thread,
in waits that end as soon as the results are in and that a signal interrupts, so a
KeyboardInterrupt lands here and can be forwarded to the engines as SIGINT.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

import ipyparallel as ipp
from ipyparallel import error as ipp_error

from axon_nb.cluster.control import held_interrupts, witnessed_interrupts
from axon_nb.cluster.hangs import HangWatch
from axon_nb.cluster.rank_displays import LiveOutput
from axon_nb.errors import AxonError, RankDiedError, RankError

FLUSH_S = 0.05
"""While waiting, streamed output is copied (and ``tick`` called) at least this often."""
OUTPUT_GRACE_S = 1.0
"""Once the results are in, how long their last output (it travels apart) may lag behind."""
FAILURE_GRACE_S = 2.0
"""After one rank fails, how long the others get to finish or fail on their own."""
STUCK_AFTER_S = 2.0
"""A rank still busy this long after SIGINT is taken to be waiting in a collective."""
RELEASE_ROUND_S = 1.0
"""How long released ranks get to leave their collective before the next release round."""
INTERRUPT_GRACE_S = 10.0
"""After SIGINT and ``STUCK_AFTER_S``, how long ranks get to unwind (released round after
round when some are left in a collective) before the kernel stops waiting."""


class RankControl(Protocol):
    """What waiting needs from the cluster to unstick ranks."""

    interrupted_at: float | None
    """When SIGINT last went to ranks (``time.monotonic()``); None before."""

    def interrupt(self, ranks: list[int]) -> None:
        """Send SIGINT to ``ranks``."""

    def abort(self, work: dict[int, list[str]]) -> None:
        """Make each rank in ``work`` skip its messages if it has not started them yet."""

    def release(self, stuck: list[int]) -> None:
        """Make ``stuck`` ranks' pending collectives fail (their peers already left them)."""

    def where(self, ranks: list[int]) -> str:
        """Where ``ranks`` are now, one line per place (a stack report); "" if unknown."""

    def check_in_step(self) -> None:
        """Once no rank is busy: re-form the world if ranks issued different collectives."""


def wait_for_ranks(
    ar: ipp.AsyncResult,
    ranks: list[int],
    *,
    control: RankControl,
    timeout: float | None = None,
    stream: bool = True,
    out: TextIO | None = None,
    err: TextIO | None = None,
    tick: Callable[[], None] | None = None,
    soft_stop_s: float | None = None,
    hang: HangWatch | None = None,
    interrupted: bool = False,
    settle_deaths: bool = True,
) -> dict[int, ipp.AsyncResult]:
    """Wait for ``ar`` (one message per rank, in ``ranks`` order) and return its parts by rank.

    Raises :class:`RankError` (or :class:`RankDiedError`) for the lowest failing rank as soon
    as a failure is known, after giving the other ranks a short grace period and interrupting
    those still running. Ctrl-C interrupts the ranks with SIGINT, waits for them to unwind
    and re-raises ``KeyboardInterrupt``.

    Returns as soon as every rank's result and output are in. ``tick`` is called every
    ``FLUSH_S`` at most while waiting (to read streamed metrics). With ``soft_stop_s``, the
    ranks treat SIGINT as "stop at the next safe point" (the training loop does): Ctrl-C then
    waits up to that long for them to finish on their own and returns normally; a second
    Ctrl-C, or the time running out, interrupts them as above. ``hang`` is told of progress
    (a rank finishing or printing) and reports a hang once. ``interrupted``: a Ctrl-C came
    while the work was being sent (``control.held_interrupts``); it is handled first thing.
    """
    parts = dict(zip(ranks, ar.split(), strict=True))
    # Completion order tells cause from consequence: the rank that raised (or died) first
    # finishes first; peers then fail in collectives or are taken down with it.
    order: list[int] = []
    for rank, part in parts.items():
        part.add_done_callback(lambda _, rank=rank: order.append(rank))
    streams = LiveOutput(parts, out or sys.stdout, err or sys.stderr) if stream else None
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        running = ""
        try:
            if interrupted:
                raise KeyboardInterrupt
            with witnessed_interrupts() as witness:
                while not _all_ready(parts):
                    if witness.arrived:  # (and its KeyboardInterrupt was lost)
                        raise KeyboardInterrupt
                    _flush(streams)
                    if tick is not None:
                        tick()
                    if hang is not None:
                        hang.check(_progress(parts))
                    failed = _failed(parts)
                    if failed:
                        deaths = [r for r in failed if _is_engine_death(parts[r].exception())]
                        if deaths and not settle_deaths:
                            break
                        running = _settle_after_failure(parts, control, streams)
                        break
                    _wait_all(parts, _next_wait_s(parts, control, deadline, timeout))
            wait_for_output(parts, OUTPUT_GRACE_S)
        except KeyboardInterrupt:
            if soft_stop_s is None or not _soft_stop(parts, control, streams, soft_stop_s):
                _forward_interrupt(parts, control, streams)
                raise
        _raise_failures(parts, order, running)
        return parts
    finally:  # what the ranks printed last shows, however the wait ends
        if streams is not None:
            streams.finish()


def _next_wait_s(
    parts: dict[int, ipp.AsyncResult],
    control: RankControl,
    deadline: float | None,
    timeout: float | None,
) -> float:
    """How long the wait's next round may block: ``FLUSH_S``, or less before ``deadline``.
    Past it, the ranks still running are interrupted and the wait fails."""
    if deadline is None:
        return FLUSH_S
    left = deadline - time.monotonic()
    if left < 0:
        late = _running(parts)
        _interrupt(parts, control, late)
        raise AxonError(
            f"ranks {_fmt(late)} did not finish within {timeout:.0f} s; they were interrupted"
        )
    return min(FLUSH_S, left)


def _flush(streams: LiveOutput | None) -> None:
    if streams is not None:
        streams.flush()


def _progress(parts: dict[int, ipp.AsyncResult]) -> tuple[int, ...]:
    """Changes whenever a rank finishes or prints."""
    return tuple(p.ready() + 2 * _length(p.stdout) + 2 * _length(p.stderr) for p in parts.values())


def _length(text: str | list[str] | None) -> int:
    if isinstance(text, list):
        return sum(len(t) for t in text)
    return len(text or "")


def _all_ready(parts: dict[int, ipp.AsyncResult]) -> bool:
    return all(p.ready() for p in parts.values())


def _wait_all(parts: dict[int, ipp.AsyncResult], seconds: float) -> None:
    """Block until every part is ready or ``seconds`` pass, whichever comes first.

    ``AsyncResult.wait`` blocks on a ``threading.Event`` set by the client's IO thread when the
    result arrives, so this returns at once when the results are in; on the main thread a
    signal interrupts it (Ctrl-C raises ``KeyboardInterrupt`` here).
    """
    end = time.monotonic() + seconds
    for part in parts.values():
        left = end - time.monotonic()
        # (ipyparallel takes a negative timeout as "forever")
        if left <= 0 or not part.wait(left):
            return


def wait_for_output(parts: dict[int, ipp.AsyncResult], seconds: float) -> None:
    """Wait up to ``seconds`` for the ready parts' output (it may trail their results)."""
    end = time.monotonic() + seconds
    for part in parts.values():
        left = end - time.monotonic()
        if part.ready() and (left <= 0 or not part.wait_for_output(left)):
            return


def _running(parts: dict[int, ipp.AsyncResult]) -> list[int]:
    return [r for r, p in parts.items() if not p.ready()]


def _failed(parts: dict[int, ipp.AsyncResult]) -> list[int]:
    """Ranks whose part raised; not those that skipped it (aborted before they started)."""
    return [
        r for r, p in parts.items()
        if p.ready() and not p.successful() and not isinstance(p.exception(), ipp_error.TaskAborted)
    ]  # fmt: skip


def _settle_after_failure(
    parts: dict[int, ipp.AsyncResult],
    control: RankControl,
    streams: LiveOutput | None,
) -> str:
    """Let the others finish or fail, else interrupt them; returns where they were (or "")."""
    # Others usually fail right after (a peer left a collective); collect those errors too.
    if _wait_until_ready(parts, FAILURE_GRACE_S, streams):
        return ""
    running = _running(parts)
    where = control.where(running)  # before interrupting: it moves them
    _interrupt(parts, control, running)
    _unstick(parts, control, streams)
    return where


def _interrupt(parts: dict[int, ipp.AsyncResult], control: RankControl, ranks: list[int]) -> None:
    """Stop ``ranks``' part of the work wherever it is: a rank that has not started it yet
    skips it (it would drop a SIGINT that came first, then run the work with its peers gone);
    the others get SIGINT."""
    try:
        control.abort({r: parts[r].msg_ids for r in ranks})
    finally:  # (also when a second Ctrl-C ends the wait for the abort's replies)
        control.interrupt(ranks)


def _unstick(
    parts: dict[int, ipp.AsyncResult], control: RankControl, streams: LiveOutput | None
) -> bool:
    """After SIGINT: ranks still busy are inside a collective their peers left; release them."""
    if _wait_until_ready(parts, STUCK_AFTER_S, streams):
        return True
    # Releasing frees the ranks waiting on a free peer; those may be what others wait on, so
    # release again from the ranks freed since, round after round. A round that freed nobody
    # within RELEASE_ROUND_S is no reason to stop: on a loaded machine a freed rank can take
    # longer to leave its collective, and the ranks waiting on it were then left in theirs
    # until the collective timeout (minutes). Releasing from the same ranks again changes
    # nothing. A rank that comes back from native code while others are still busy is released
    # from too, though they may be busy elsewhere: they may wait on it in a collective, and
    # re-forming the world once too often costs far less than a rank left in one.
    end = time.monotonic() + INTERRUPT_GRACE_S
    while True:
        control.release(_running(parts))
        if _wait_until_ready(parts, RELEASE_ROUND_S, streams):
            return True
        if time.monotonic() >= end:
            return False


def release_left_behind(ar: ipp.AsyncResult, ranks: list[int], control: RankControl) -> None:
    """After the kernel stopped waiting on a Ctrl-C (however quickly a second one came):
    release the ranks still inside the interrupted work, so that none is left in a collective
    its peers left (the next collective would pair with it and abort the rank). When every
    rank is still busy, the first to unwind is waited for, until ``STUCK_AFTER_S +
    INTERRUPT_GRACE_S`` after the SIGINT (as one Ctrl-C waits): until one has, none can be
    told stuck. On a loaded machine a rank can take seconds to unwind while its peer waits in
    a collective; given up on after 2 s, the rank that came out later ran the next cell's
    collective against its peer's stale one, and gloo aborted it. When none is busy, their
    collective counts are compared (``control.check_in_step``)."""
    parts = dict(zip(ranks, ar.split(), strict=True))
    sent = control.interrupted_at
    one_out = _until_one_ready(parts, time.monotonic() + STUCK_AFTER_S)
    # (no SIGINT went: the ranks run on, in step; one rank: there is no peer to release)
    if sent is not None and len(parts) > 1 and not one_out:
        end = sent + STUCK_AFTER_S + INTERRUPT_GRACE_S
        if end > time.monotonic():
            print(f"Waiting up to {end - time.monotonic():.0f} s for a rank to come out of the "
                  "interrupted call (until one has, none can be told stuck) ...",
                  file=sys.stderr)  # fmt: skip
            _until_one_ready(parts, end)
    busy = _running(parts)
    if busy and len(busy) < len(parts):
        control.release(busy)
    elif not busy:  # one may have stopped just before issuing the collective the others did
        control.check_in_step()


def _until_one_ready(parts: dict[int, ipp.AsyncResult], end: float) -> bool:
    """Wait until one part is ready or ``end`` (``time.monotonic()``); whether one is."""
    while not any(p.ready() for p in parts.values()):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def _soft_stop(
    parts: dict[int, ipp.AsyncResult],
    control: RankControl,
    streams: LiveOutput | None,
    seconds: float,
) -> bool:
    """Ask running ranks to stop at their next safe point; True once all have finished."""
    running = _running(parts)
    print(
        f"Stopping ranks {_fmt(running)} at the next step boundary "
        "(press interrupt again to stop them at once) ...",
        file=sys.stderr,
    )
    control.interrupt(running)
    try:
        return _wait_until_ready(parts, seconds, streams)
    except KeyboardInterrupt:
        return False


def _forward_interrupt(
    parts: dict[int, ipp.AsyncResult],
    control: RankControl,
    streams: LiveOutput | None,
) -> None:
    running = _running(parts)
    if not running:
        return
    try:
        print(f"Interrupting ranks {_fmt(running)} ...", file=sys.stderr)
        started = time.monotonic()
        _interrupt(parts, control, running)
        if not _unstick(parts, control, streams):
            print(
                f"ranks {_fmt(_running(parts))} are still busy "
                f"{time.monotonic() - started:.0f} s after SIGINT (stuck in native code?); "
                "`%axon_cluster --restart` starts fresh ranks",
                file=sys.stderr,
            )
    except KeyboardInterrupt:
        # A second Ctrl-C: stop waiting (the first one is being re-raised), but leave no rank
        # inside a collective its peers left: the next collective would pair with it and
        # abort the process. Released now, the world is re-formed before the next call.
        with held_interrupts():  # (a third Ctrl-C waits for the release)
            control.release(_running(parts))


def _wait_until_ready(
    parts: dict[int, ipp.AsyncResult], seconds: float, streams: LiveOutput | None
) -> bool:
    end = time.monotonic() + seconds
    while True:
        _flush(streams)
        if _all_ready(parts):
            wait_for_output(parts, OUTPUT_GRACE_S)
            _flush(streams)
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        _wait_all(parts, min(FLUSH_S, left))


def _raise_failures(parts: dict[int, ipp.AsyncResult], order: list[int], running: str) -> None:
    failed = _failed(parts)
    if not failed:
        return
    first = {rank: i for i, rank in reversed(list(enumerate(order)))}
    failed.sort(key=lambda r: (first.get(r, len(order)), r))
    # A death is the cause whenever there is one: a peer's "connection closed" may arrive first.
    deaths = [r for r in failed if _is_engine_death(parts[r].exception())]
    if deaths:
        raise RankDiedError(deaths[0], "EngineError", "its process exited", "", failed) from None
    rank = failed[0]
    exc = parts[rank].exception()
    ename, evalue, tb = describe_error(exc)
    raise RankError(rank, ename, evalue, tb, failed, running) from None


def _is_engine_death(exc: BaseException | None) -> bool:
    if isinstance(exc, ipp_error.EngineError):
        return True
    return isinstance(exc, ipp_error.RemoteError) and exc.ename == "EngineError"


def describe_error(exc: BaseException | None) -> tuple[str, str, str]:
    """``(ename, evalue, traceback)`` of an error a rank raised (remote or local)."""
    if isinstance(exc, ipp_error.TaskAborted):  # (see ``_interrupt``)
        return "KeyboardInterrupt", "interrupted before this rank started the work", ""
    if isinstance(exc, ipp_error.RemoteError):
        tb = exc.traceback if isinstance(exc.traceback, str) else "\n".join(exc.traceback or [])
        return str(exc.ename), str(exc.evalue), tb
    return type(exc).__name__, str(exc), ""


def _fmt(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def results(parts: dict[int, ipp.AsyncResult]) -> list[Any]:
    """The successful results, in rank order."""
    return [parts[r].get() for r in sorted(parts)]
