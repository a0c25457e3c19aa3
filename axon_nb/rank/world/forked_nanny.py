"""An engine's nanny forked from the engine rather than started as a new Python.

ipyparallel starts each engine's nanny (the process that passes the controller's signals on to
the engine and tells the controller when the engine is gone) as ``python -m
ipyparallel.engine.nanny``, and the engine waits for it mid-registration: about 0.25 s of wall
time and 0.27 s of CPU per rank, every start. An engine forked from the warm process
(``spec/warm_engines.py``) already holds everything the nanny imports, so it forks the nanny
from itself instead, first thing, while it still has a single thread and no socket of its
own. The child waits, and becomes the nanny once the engine knows what to tell it. It is what
ipyparallel's nanny is: the engine's child, in a session of its own, reading its settings on
standard input and writing its address on standard output, which it watches to notice the
engine's end. An engine that never asks ends it by exiting.

Example (what ``rank/world/engine.py`` does)::

    nanny = ForkedNanny.fork()  # None where the nanny's modules are not loaded yet
    if nanny is not None:
        nanny.replace_ipyparallel_start()
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
from typing import IO, Any


class ForkedNanny:
    """A child of this process that becomes its nanny when :meth:`start` sends the settings."""

    def __init__(self, pid: int, settings_w: int, address_r: int) -> None:
        self.pid = pid
        self._settings_w = settings_w
        self._address = os.fdopen(address_r, "rb")
        self._started = False

    @classmethod
    def fork(cls) -> ForkedNanny | None:
        """Fork the waiting child; None when the nanny's modules are not imported (a plain
        engine process: ipyparallel then starts its nanny as usual)."""
        if "ipyparallel.engine.nanny" not in sys.modules:
            return None
        settings_r, settings_w = os.pipe()
        address_r, address_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _wait_then_run(settings_r, address_w)  # never returns
        os.close(settings_r)
        os.close(address_w)
        return cls(pid, settings_w, address_r)

    def start(self, **settings: Any) -> tuple[str, IO[bytes]]:
        """ipyparallel's ``start_nanny``: the nanny's address, and the pipe to keep open for
        as long as the engine runs (the nanny watches it)."""
        if self._started:
            raise RuntimeError("this engine's nanny was started already")
        self._started = True
        settings["pid"] = os.getpid()
        with os.fdopen(self._settings_w, "wb") as f:
            f.write(pickle.dumps(settings))
        address = self._address.readline().decode().strip()
        if not address:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            raise RuntimeError("the engine's nanny failed to start (see the cluster's log)")
        return address, self._address

    def replace_ipyparallel_start(self) -> None:
        """Have ipyparallel's engine take this nanny instead of starting one."""
        import ipyparallel.engine.app as app

        app.start_nanny = self.start  # type: ignore[assignment]


def _wait_then_run(settings_r: int, address_w: int) -> None:
    """(In the forked child) as ``python -m ipyparallel.engine.nanny`` with these pipes as its
    standard input and output; never returns."""
    code = 0
    try:
        os.setsid()  # the engine's group signals (Ctrl-C, hydra's) are not the nanny's
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.dup2(settings_r, 0)
        os.dup2(address_w, 1)
        os.closerange(3, _max_fd())  # (MPI's connection among them: only the engine's)
        with os.fdopen(0, "rb") as f:
            data = f.read()
        if data:  # (nothing: the engine ended without asking)
            from ipyparallel.engine.nanny import KernelNanny

            settings = pickle.loads(data)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            KernelNanny.main(pipe=sys.stdout, **settings)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1024
