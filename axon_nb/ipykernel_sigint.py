"""Ctrl-C in an ipykernel process interrupts the user's code and nothing else.

Both sides run ipykernel: the notebook's kernel and every rank's engine. ipykernel makes
SIGINT raise ``KeyboardInterrupt`` for the whole time it handles a request: also while it
unpacks the request, before the user's code starts, and while it packs and sends the reply
after it ended. A ``KeyboardInterrupt`` there is caught by ipykernel's dispatcher without a
reply: on an engine it left the event loop and ended the rank; in the notebook's kernel the
cell never got its ``execute_reply`` and stayed busy ("[*]") for good. A Ctrl-C that comes as
a cell ends lands there often on a busy machine.

:func:`install` replaces that handler with one that raises only when the interrupted frame
runs below the code that executes the user's cell (IPython's ``run_code``) or function
(ipyparallel's ``do_apply``), not in their handling of how it ended (formatting its
traceback). Elsewhere the process is between the user's code and the reply, and the interrupt
is dropped: the cell has ended. With ``hold_during_imports`` (the engines), an interrupt that
comes while a module is being imported is raised once the import is over (a module
interrupted mid-import stays broken, ``rank/world/interrupts.py``).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

RUNNERS = {
    ("run_code", "interactiveshell.py"),
    ("do_apply", "kernel.py"),
    ("run_relayed", "relay.py"),
}
"""(function, file) of the frames that run the user's code: IPython's cell runner,
ipyparallel's function-call handler and the host relay's (``rank/world/relay.py``)."""
MACHINERY = ("IPython", "ipykernel", "ipyparallel")
"""Packages whose frames directly below a runner are its bookkeeping, not the user's code."""
RETRY_S = 0.05
"""How soon an interrupt held back during an import is tried again."""


def in_user_code(frame: FrameType | None) -> bool:
    """True when ``frame`` runs in the user's code (or what it calls): below a runner, and
    not in the runner's own handling of how the code ended (IPython's ``showtraceback`` is
    called from ``run_code`` too)."""
    child = None
    while frame is not None:
        code = frame.f_code
        if (code.co_name, os.path.basename(code.co_filename)) in RUNNERS:
            return child is not None and not _machinery(child.f_code.co_filename)
        child, frame = frame, frame.f_back
    return False


def in_import(frame: FrameType | None) -> bool:
    """True when ``frame`` (a signal handler's) is executing inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _machinery(filename: str) -> bool:
    parts = filename.replace(os.sep, "/").split("/")
    return any(package in parts for package in MACHINERY)


def interrupt_user_code(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler: ``KeyboardInterrupt`` in the user's code, nothing elsewhere."""
    if in_user_code(frame):
        raise KeyboardInterrupt


def interrupt_user_code_after_imports(signum: int, frame: FrameType | None) -> None:
    """As :func:`interrupt_user_code`, but raised only once any import in progress is over."""
    if not in_user_code(frame):
        return
    if in_import(frame):
        threading.Timer(RETRY_S, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


def install(*, hold_during_imports: bool = False) -> None:
    """Use :func:`interrupt_user_code` where ipykernel would use ``default_int_handler``, in
    this process, from its next request on. Idempotent. Example (the engines, before they
    start; the notebook's kernel does the same when a cluster starts)::

        install(hold_during_imports=True)
    """
    from ipykernel.kernelbase import Kernel

    handler = interrupt_user_code_after_imports if hold_during_imports else interrupt_user_code

    def pre_handler_hook(self: Kernel) -> None:
        self.saved_sigint_handler = signal.signal(signal.SIGINT, handler)

    Kernel.pre_handler_hook = pre_handler_hook  # type: ignore[method-assign]  # (a patch)
