"""On an engine, Ctrl-C interrupts the user's code and nothing else.

ipykernel makes SIGINT raise ``KeyboardInterrupt`` for the whole time it handles a request:
also while it unpacks the request, before the user's code starts, and while it packs and
sends the reply after it ended. A ``KeyboardInterrupt`` there is caught by nothing, leaves the
event loop and ends the engine: on a busy machine, a Ctrl-C that came as a cell ended cost a
rank. :func:`install` replaces that handler with one that raises only when the interrupted
frame runs below the code that executes the user's cell (IPython's ``run_code``) or function
(ipyparallel's ``do_apply``), not in their handling of how it ended (formatting its
traceback), and holds it back while an import is in progress (a module
interrupted mid-import stays broken, ``interrupts.py``). Elsewhere the engine is between the
user's code and the reply, and the interrupt is dropped: the cell has ended.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from axon_nb.rank.world.interrupts import RETRY_S, in_import

RUNNERS = {("run_code", "interactiveshell.py"), ("do_apply", "kernel.py")}
"""(function, file) of the frames that run the user's code: IPython's cell runner and
ipyparallel's function-call handler."""


def in_user_code(frame: FrameType | None) -> bool:
    """True when ``frame`` runs in the user's code (or what it calls): below a runner, and
    not in the runner's own handling of how the code ended (IPython's ``showtraceback`` is
    called from ``run_code`` too; an interrupt there would end the engine)."""
    child = None
    while frame is not None:
        code = frame.f_code
        if (code.co_name, os.path.basename(code.co_filename)) in RUNNERS:
            return child is not None and not _machinery(child.f_code.co_filename)
        child, frame = frame, frame.f_back
    return False


MACHINERY = ("IPython", "ipykernel", "ipyparallel")
"""Packages whose frames directly below a runner are its bookkeeping, not the user's code."""


def _machinery(filename: str) -> bool:
    parts = filename.replace(os.sep, "/").split("/")
    return any(package in parts for package in MACHINERY)


def interrupt_user_code(signum: int, frame: FrameType | None) -> None:
    """The engine's SIGINT handler while it handles a request (see the module doc)."""
    if not in_user_code(frame):
        return
    if in_import(frame):  # raised once the import is over
        threading.Timer(RETRY_S, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


def install() -> None:
    """Use :func:`interrupt_user_code` where ipykernel would use ``default_int_handler``.
    Example (``rank/world/engine.py``, before the engine starts)::

        install()
    """
    from ipykernel.kernelbase import Kernel

    def pre_handler_hook(self: Kernel) -> None:
        self.saved_sigint_handler = signal.signal(signal.SIGINT, interrupt_user_code)

    Kernel.pre_handler_hook = pre_handler_hook  # type: ignore[method-assign]
