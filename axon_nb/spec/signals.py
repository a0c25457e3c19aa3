"""Signals both sides agree on, and a loop's wake-up on a signal."""

from __future__ import annotations

import contextlib
import os
import signal

NATIVE_SIGNAL = signal.SIGUSR1
"""Sent to a rank that does not answer a stack request (holding the GIL in native code):
``faulthandler`` dumps its stacks from C (``rank/observe/watch.py`` registers it)."""


def wakeup_pipe() -> tuple[int, int]:
    """A non-blocking pipe (read end, write end) that each signal with a Python handler
    writes to (``signal.set_wakeup_fd``): a loop waiting in ``select`` on the read end wakes
    at once instead of at its next poll. Example::

        woken, _ = wakeup_pipe()
        if select.select([woken], [], [], 1.0)[0]:
            drain(woken)
    """
    read_end, write_end = os.pipe()
    for end in (read_end, write_end):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(write_end)
    return read_end, write_end


def drain(read_end: int) -> None:
    """Read what signals wrote to :func:`wakeup_pipe`'s read end (so the next wait waits)."""
    with contextlib.suppress(BlockingIOError):
        os.read(read_end, 4096)
