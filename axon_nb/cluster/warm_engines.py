"""The kernel's warm process for this host's engines (``spec/warm_engines.py``).

Started when this kernel starts ranks on this host, it lives as long as some cluster of the
kernel runs: a start, restart or recovery forks its engines from it instead of starting each
as a new Python that imports torch (about 3 CPU-s per rank; a 2-rank start, one cell and a
stop take about a quarter of the CPU: ``benchmarks/forked_engines.py``). It holds no GPU (it
never touches CUDA) and no rank. ``Cluster.stop`` ends it once no engine it forked runs (a
restart keeps it for the start that follows); it also ends when the kernel does, SIGKILLed or
not (it watches its parent), with any engine still running.

Ranks on other hosts, in a Slurm job, or with ``AXON_NB_WARM_ENGINES=0`` in the kernel's
environment start as new processes. Example::

    directory = server_directory()  # starts it if needed; None when engines start plain
    environment = {SERVER_ENV: directory} if directory else {}
    ...
    stop_if_idle()  # after a stop: ends it unless another cluster's engines run
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from axon_nb.cluster.private_paths import private_cache_environment
from axon_nb.spec.warm_engines import SWITCH_ENV, log_path, socket_path

T = TypeVar("T")

SERVER_CMD = [sys.executable, "-m", "axon_nb.rank.world.engine_server"]
"""The server's command; its directory is added last."""

SOCKET_WAIT_S = 10.0
"""How long a new server may take to listen before engines start without it."""

_lock = threading.Lock()
_server: subprocess.Popen[bytes] | None = None
_directory: str | None = None
_started_with: tuple[object, ...] = ()
_failed = False


def server_directory() -> str | None:
    """The running server's directory, started if needed; None when it is switched off or
    did not start (engines then start as new processes, as before)."""
    global _server, _directory, _started_with
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    fingerprint = _fingerprint()
    with _lock:
        if _server is not None and _server.poll() is None:
            if fingerprint == _started_with:
                return _directory
            if _running_children(_server.pid):  # another cluster's engines run on it
                return None
        _end_server()  # (gone, or started with other packages or settings: a new one)
        if _failed:
            return None
        _started_with = fingerprint
        directory = tempfile.mkdtemp(prefix="axon-engines-")  # owner-only
        try:
            with open(log_path(directory), "ab") as log:
                server = subprocess.Popen(
                    [*SERVER_CMD, directory],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # the kernel's interrupts are not the engines'
                    env={**os.environ, **private_cache_environment()},
                )
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)
            return None
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not os.path.exists(socket_path(directory)):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                server.wait()
                _server, _directory = server, directory
                _end_server()  # (warns with its output, removes its directory)
                return None
            time.sleep(0.02)
        _server, _directory = server, directory
        return directory


def server_pid() -> int | None:
    """The pid of this kernel's server while it runs, else None."""
    with _lock:
        if _server is not None and _server.poll() is None:
            return _server.pid
    return None


def stop_if_idle() -> None:
    """End the server unless an engine it forked still runs (another cluster's)."""
    with _lock:
        if _server is None:
            return
        if _server.poll() is None and _running_children(_server.pid):
            return
        _end_server()


def _end_server() -> None:
    """(Holding the lock) end the server, if any, and remove its directory."""
    global _server, _directory
    if _server is not None:
        _note_failure()
        _server.terminate()  # (it SIGKILLs what it forked)
        try:
            _server.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
    if _directory is not None:
        shutil.rmtree(_directory, ignore_errors=True)
    _server, _directory = None, None


LOAD_TIME_ENV = ("LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "TORCH_")
"""Settings read as libraries and modules load: the server's copy of them is its engines'."""


def _fingerprint() -> tuple[object, ...]:
    """What the server's imports depend on (this interpreter, the load-time settings, the
    installed versions, axon_nb's sources): a change means a new server, so that engines
    stay what a new process would be (after ``%pip install -U torch``, say)."""
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(LOAD_TIME_ENV))
    versions: list[str | None] = []
    for package in ("torch", "ipyparallel", "ipykernel", "mpi4py", "numpy"):
        try:
            versions.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    sources = Path(__file__).resolve().parent.parent
    newest = max((p.stat().st_mtime for p in sources.rglob("*.py")), default=0.0)
    return (sys.executable, tuple(environment), tuple(versions), newest)


def ended_on_failure(start: Callable[[], T]) -> T:
    """``start()``, ending the server (unless other engines run) if it fails: what a restart
    kept it for did not come. Example: ``warm_engines.ended_on_failure(cluster.start)``."""
    try:
        return start()
    except BaseException:
        stop_if_idle()
        raise


def _running_children(pid: int) -> list[int]:
    """The children of ``pid`` that run (a zombie, an engine not yet reaped, has ended)."""
    running = []
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                running.append(child.pid)
        except psutil.Error:
            continue
    return running


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no output)"


def _note_failure() -> None:
    """(Holding the lock) if the server ended on its own with an error, warn once, with its
    output, and start no other in this kernel."""
    global _failed
    if _server is None or _server.poll() in (None, 0) or _failed:
        return
    _failed = True
    warnings.warn(
        "axon_nb: the warm process for engines failed; engines start as new processes "
        f"(slower). Its output:\n{_tail(log_path(_directory or ''))}",
        RuntimeWarning,
        stacklevel=3,
    )
