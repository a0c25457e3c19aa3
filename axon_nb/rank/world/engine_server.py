"""The warm process that forks this host's engines (``spec/warm_engines.py``).

It imports what an engine imports (torch, ipyparallel's engine, axon_nb's rank modules), once,
without touching MPI, CUDA or a torch op (no thread pool exists to be broken by ``fork``), then
waits. A rank's parent (``rank/world/forked_engine.py``) connects and sends its command line,
environment, working directory and open file descriptors (``SCM_RIGHTS``: its output and
MPI's ``PMI_FD`` among them); the server forks, the child puts them back at the same numbers
and runs the engine module as ``python -m`` would. The parent gets the engine's pid, then its
exit code once the server has reaped it.

Lifetimes, so nothing outlives its owner:

- an engine is SIGKILLed (with its nanny) when its rank's parent's connection closes before
  the engine ended (the parent died), and when the server dies (``PR_SET_PDEATHSIG``);
- the server ends, SIGKILLing its engines, when the kernel that started it is gone (its
  parent pid changes) or on SIGTERM.

Usage (what ``cluster/warm_engines.py`` runs, in a session of its own)::

    python -m axon_nb.rank.world.engine_server DIRECTORY
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

from axon_nb.rank.world.forked_engine import ENGINE_MODULE
from axon_nb.rank.world.launch import kill_tree, set_death_signal
from axon_nb.spec.notice_signal import ENV as NOTICE_ENV
from axon_nb.spec.notice_signal import notice_signum
from axon_nb.spec.signals import drain, wakeup_pipe
from axon_nb.spec.warm_engines import engines_dir, socket_path

PARENT_POLL_S = 0.5
"""How often the server checks that the kernel that started it is alive."""

LATER_IMPORTS_IDLE_S = 5.0
"""The server imports what engines import later (``_later_imports``) once no parent has
asked for an engine for this long: never in the middle of a start."""

MAX_FDS = 64
"""The most file descriptors one request may carry."""


def _preload() -> None:
    """What every engine imports (``rank/world/engine.py`` and the first requests' modules)."""
    with _frozen_after():
        _import_engine_modules()


def _import_engine_modules() -> None:
    import ipyparallel.engine.app  # noqa: F401
    import mpi4py  # noqa: F401  (the package only: the engine initializes MPI)
    import torch
    import torch.distributed  # noqa: F401

    import axon_nb.ipykernel_sigint
    import axon_nb.rank.entry
    import axon_nb.rank.world.bootstrap
    import axon_nb.rank.world.forked_nanny  # noqa: F401

    # (not the engine module itself: it runs as __main__ in each child, as `python -m` runs it)
    _check_forkable()


def _later_imports() -> None:
    """What most engines import later, on their first DDP, FSDP or compile: ``torch._dynamo``
    (1.0 s of CPU in each engine that imports it). The server imports it once, when no parent
    has asked for an engine for a while, so that no start waits for it or competes with it."""
    with _frozen_after():
        import torch._dynamo  # noqa: F401

    _check_forkable()


@contextlib.contextmanager
def _frozen_after() -> Iterator[None]:
    """Import with the cycle collector off, then freeze every object there is: Python's
    recipe for a process that forks (``gc.freeze``). Imports make hundreds of thousands of
    objects and few cycles, and collecting as they grew walked them again and again (the
    engine modules 1.57-1.77 CPU-s with it, 1.40-1.61 without). Frozen, no collection walks
    them again, in the server or in an engine it forks (a full one took 0.11 s there, and
    wrote to every page holding one: pages the engine then had to copy). The few cycles the
    imports left (100,000 objects, no open file among them) stay, in memory pymalloc would
    not have given back anyway (the same resident size)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _check_forkable() -> None:
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA: fork nothing
        raise RuntimeError("CUDA was initialized while importing; engines start as processes")
    if threading.active_count() > 1:  # a thread would be missing, maybe holding a lock
        raise RuntimeError("a thread was started while importing; engines start as processes")


def _peer_pid(conn: socket.socket) -> int:
    """The pid of the process at the other end of ``conn``; refuses another user's."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():
        raise PermissionError(f"a process of user {uid} asked for an engine")
    return pid


def _answer(conn: socket.socket, message: dict) -> None:
    """One reply to a rank's parent: a JSON line (``{"pid": ...}``, then ``{"exit": ...}``)."""
    conn.sendall(json.dumps(message).encode() + b"\n")


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: JSON ending in a newline; the descriptors come with its first bytes.
    Refused (its descriptors closed) when incomplete, or when its parent has gone since."""
    conn.settimeout(10.0)
    data, fds, flags, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    try:
        if flags & socket.MSG_CTRUNC:
            raise ValueError(f"more than {MAX_FDS} descriptors")
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 16)
            if not more:
                raise ConnectionError("the request ended early")
            data += more
        request = json.loads(data)
        if len(request["fd_numbers"]) != len(fds):
            raise ValueError("the descriptors do not match their numbers")
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            if conn.recv(1, socket.MSG_PEEK) == b"":
                raise ConnectionError("the rank's parent gave up waiting")
        conn.setblocking(True)
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class _Server:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.parent = os.getppid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_path(directory))
        self.listener.listen(128)
        os.makedirs(engines_dir(directory), exist_ok=True)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        # SIGCHLD wakes the loop through this pipe (an engine ended: reap it at once).
        self.wake_r, self.wake_w = wakeup_pipe()
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.engines: dict[int, tuple[socket.socket, int]] = {}  # pid -> (connection, parent)
        self.last_request = time.monotonic()

    def serve(self) -> None:
        later_imports = True
        while os.getppid() == self.parent:
            events = self.selector.select(PARENT_POLL_S)
            idle = time.monotonic() - self.last_request
            if later_imports and not events and idle > LATER_IMPORTS_IDLE_S:
                later_imports = False
                self._import_later_modules()
            for key, _ in events:
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj == self.wake_r:
                    drain(self.wake_r)
                elif isinstance(key.fileobj, socket.socket):  # (a parent's connection)
                    self._closed(key.fileobj)
            self._reap()

    def _import_later_modules(self) -> None:
        """Import what engines import later; should that fail or make forking unsafe, the
        server forks no more engines (their parents start them as processes) and keeps
        serving the ones it has."""
        try:
            _later_imports()
        except Exception as e:
            print(
                f"axon_nb engine server: {e}; later engines start as processes",
                file=sys.stderr,
                flush=True,
            )
            self.selector.unregister(self.listener)
            self.listener.close()

    def _accept(self) -> None:
        """Fork the engine one rank's parent asks for. A request that fails (its parent then
        starts the engine as a process) never ends the server, whose other engines run."""
        self.last_request = time.monotonic()
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            parent = _peer_pid(conn)
            request, fds = _read_request(conn)
        except (OSError, ValueError, KeyError) as e:
            print(f"axon_nb engine server: refused a request: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        try:
            server_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                self._become_engine(request, fds, conn, server_pid)
        except OSError as e:  # (no memory or process left for it)
            print(f"axon_nb engine server: could not fork: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.engines[pid] = (conn, parent)
        with contextlib.suppress(OSError):
            record = os.path.join(engines_dir(self.directory), str(parent))
            with open(record + ".new", "w") as f:
                f.write(str(pid))
            os.replace(record + ".new", record)
            _answer(conn, {"pid": pid})
        self.selector.register(conn, selectors.EVENT_READ)

    def _closed(self, conn: socket.socket) -> None:
        """A parent's connection is readable: it closed. SIGKILL its engine if that runs."""
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            if conn.recv(4096):
                return  # (a parent sends nothing more: stray bytes are dropped)
        for pid, (engine_conn, _) in list(self.engines.items()):
            if engine_conn is conn:
                kill_tree(pid)  # reaped, and forgotten, by _reap
        self.selector.unregister(conn)

    def _reap(self) -> None:
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    return
                conn, parent = self.engines.pop(pid, (None, 0))
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(engines_dir(self.directory), str(parent)))
                if conn is not None:
                    with contextlib.suppress(OSError):
                        _answer(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(conn)
                    conn.close()

    def close(self) -> None:
        """The kernel is gone (or SIGTERM): the engines go too."""
        for pid in list(self.engines):
            kill_tree(pid)
        deadline = time.monotonic() + 5.0
        while self.engines and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        self.listener.close()

    def _become_engine(
        self, request: dict, fds: list[int], conn: socket.socket, server_pid: int
    ) -> None:
        """(In the forked child) become the engine the request describes; never returns."""
        code = 1
        try:
            set_death_signal(signal.SIGKILL)  # the server died: so does this engine
            if os.getppid() != server_pid:  # (it died before the death signal was set)
                os._exit(1)
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as rank/world/launch.py leaves it
            for notice in {signal.SIGUSR2, notice_signum(os.environ.get(NOTICE_ENV, "USR2"))}:
                signal.signal(notice, signal.SIG_IGN)  # (likewise, until a run takes it)
            self.selector.close()
            for other, _ in self.engines.values():
                other.close()
            conn.close()
            self.listener.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            _take_descriptors(fds, request["fd_numbers"])
            code = _run_engine(request)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            if code < 0:  # ended by this signal, as Python ends on an uncaught Ctrl-C
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code if code >= 0 else 128 - code)


def _take_descriptors(fds: list[int], numbers: list[int]) -> None:
    """Put the received ``fds`` at the ``numbers`` they had in the rank's parent."""
    above = max([2, *numbers]) + 1  # out of the targets' way
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for number, fd in zip(numbers, moved, strict=True):
        os.dup2(fd, number)  # (inheritable, as in a process the parent started)
        os.close(fd)


def _run_engine(request: dict) -> int:
    """Run the engine module as ``python -m`` would, in the parent's environment and directory;
    its exit code."""
    import atexit
    import runpy

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *path, *(p for p in sys.path[1:] if p not in path)]
    if "numpy" in sys.modules:  # (Python's random reseeds itself in a forked child)
        sys.modules["numpy"].random.seed()
    sys.argv = [ENGINE_MODULE, *request["args"]]
    code = 0
    try:
        runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    # As an interpreter exits: wait for its other threads, then run the atexit functions.
    with contextlib.suppress(BaseException):
        cast(Any, threading)._shutdown()  # (private: typeshed does not declare it)
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    return code


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m axon_nb.rank.world.engine_server DIRECTORY", file=sys.stderr)
        return 2
    server = _Server(argv[0])  # listening first: parents queue while it imports
    try:
        _preload()
    except BaseException:
        server.close()  # (its directory stays: the kernel shows this output, then removes it)
        raise
    try:
        server.serve()
    except SystemExit:
        pass
    finally:
        server.close()
        shutil.rmtree(argv[0], ignore_errors=True)
    return 0


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    # Everything is cleaned up: leave without tearing down torch's modules, half a second of
    # a stop's time (the kernel waits for this process to end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
