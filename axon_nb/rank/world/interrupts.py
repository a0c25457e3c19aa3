"""Ctrl-C on a rank that never lands inside an import, and that stops training politely.

A ``KeyboardInterrupt`` raised while a module is being imported for the first time leaves it
half-initialised in ``sys.modules``: every later use fails until the process restarts (torch
imports sympy lazily, during a run's first steps). While :func:`import_safe_interrupts` is
active, a SIGINT that arrives inside an import is held back and raised as soon as the import
is over (re-checked every ``RETRY_S``), or when the guarded block ends.

Example::

    with import_safe_interrupts():
        model = build_model()       # Ctrl-C here waits for any import in progress
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from axon_nb.ipykernel_sigint import RETRY_S, in_import


class _Guard:
    """Raises ``KeyboardInterrupt`` for a SIGINT, or while inside an import, holds it back
    and re-sends it every ``RETRY_S`` for as long as ``active``."""

    def __init__(self) -> None:
        self.active = True
        self.pending = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if not in_import(frame):
            self.pending = False
            raise KeyboardInterrupt
        self.pending = True
        threading.Timer(RETRY_S, self._retry).start()

    def _retry(self) -> None:
        if self.active and self.pending:
            os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def import_safe_interrupts() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` as usual, except never inside an import."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    guard = _Guard()
    saved: Any = signal.signal(signal.SIGINT, guard.handle)
    try:
        yield
    finally:
        guard.active = False
        signal.signal(signal.SIGINT, saved)
    if guard.pending:  # it arrived in an import that ended with the block
        raise KeyboardInterrupt


class StopSignal:
    """While active, the first SIGINT asks to stop at the next step boundary (the training
    loop reads ``requested``); a second one raises ``KeyboardInterrupt``, except inside an
    import (it is tried again once the import is over). ``cluster.train``'s Ctrl-C and
    ``handle.stop()`` both arrive as SIGINT.

    Example::

        with StopSignal() as stop:
            while not stop.requested:
                step()
    """

    def __init__(self) -> None:
        self.requested = False
        """A stop was asked for: a first SIGINT, or another reason (a preemption notice)."""
        self._interrupted = False  # (a SIGINT came: the next one interrupts)
        self._saved: Any = None
        self._guard = _Guard()  # for the second and later ones

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._saved = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._guard.active = False
        if self._saved is not None:
            signal.signal(signal.SIGINT, self._saved)
            self._saved = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._interrupted:  # (a stop asked for otherwise does not count as the first)
            self._interrupted = self.requested = True
            return
        self._guard.handle(signum, frame)
