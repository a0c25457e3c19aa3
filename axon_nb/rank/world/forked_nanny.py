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
engine's end; like it, it keeps only the engine's standard error (the cluster's log). An
engine that never asks ends it by exiting. Where the fork or the waiting child fails,
ipyparallel starts its nanny as usual.

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
from collections.abc import Callable
from typing import Any


class ForkedNanny:
    """A child of this process that becomes its nanny when :meth:`start` sends the settings."""

    def __init__(self, pid: int, settings_w: int, address_r: int) -> None:
        self.pid = pid
        self._settings_w = settings_w
        self._address = os.fdopen(address_r, "rb")
        self._started = False
        self._ipyparallel_start: Callable[..., tuple[str, Any]] | None = None

    @classmethod
    def fork(cls) -> ForkedNanny | None:
        """Fork the waiting child; None when the nanny's modules are not imported (a plain
        engine process: ipyparallel then starts its nanny as usual) or the fork fails."""
        if "ipyparallel.engine.nanny" not in sys.modules:
            return None
        fds: list[int] = []
        try:
            settings_r, settings_w = os.pipe()
            fds += [settings_r, settings_w]
            address_r, address_w = os.pipe()
            fds += [address_r, address_w]
            pid = os.fork()
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
        if pid == 0:
            try:
                _wait_then_run(settings_r, address_w)
            finally:
                os._exit(1)  # (never back into the engine's code)
        os.close(settings_r)
        os.close(address_w)
        return cls(pid, settings_w, address_r)

    def start(self, **settings: Any) -> tuple[str, Any]:
        """ipyparallel's ``start_nanny``: the nanny's address, and what to keep for as long
        as the engine runs (the nanny watches the pipe). A child that is gone or fails leaves
        it to ipyparallel's own start."""
        if self._started:
            raise RuntimeError("this engine's nanny was started already")
        self._started = True
        address = ""
        with contextlib.suppress(OSError):  # (a child that is gone: a broken pipe)
            with os.fdopen(self._settings_w, "wb") as f:
                f.write(pickle.dumps({**settings, "pid": os.getpid()}))
            address = self._address.readline().decode().strip()
        if address:
            return address, self._address
        self._address.close()
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        print("axon_nb: the forked nanny failed; starting it as a process", file=sys.stderr)
        if self._ipyparallel_start is not None:
            return self._ipyparallel_start(**settings)
        from ipyparallel.engine.nanny import start_nanny

        return start_nanny(**settings)

    def replace_ipyparallel_start(self) -> None:
        """Have ipyparallel's engine take this nanny instead of starting one."""
        import ipyparallel.engine.app as app

        self._ipyparallel_start = app.start_nanny
        app.start_nanny = self.start


def _wait_then_run(settings_r: int, address_w: int) -> None:
    """(In the forked child) as ``python -m ipyparallel.engine.nanny`` with these pipes as its
    standard input and output; ends the process."""
    import gc

    gc.freeze()  # the engine's objects: never walked (nor their pages copied) by a collection
    code = 0
    try:
        os.setsid()  # the engine's group signals (Ctrl-C, hydra's) are not the nanny's
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.dup2(settings_r, 0)
        os.dup2(address_w, 1)
        _close_all_but_standard()  # (MPI's connection among them: only the engine's)
        with os.fdopen(0, "rb") as f:
            data = f.read()
        try:
            settings = pickle.loads(data)
        except Exception:  # nothing, or cut short: the engine ended without asking
            settings = None
        if settings is not None:
            from ipyparallel.engine.nanny import KernelNanny

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


def _close_all_but_standard() -> None:
    """Close every descriptor above 2 (those open only, where ``/proc`` lists them: a high
    limit on open files then costs nothing)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        os.closerange(3, 65536)
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):  # (the listing's own, closed already)
                os.close(fd)
