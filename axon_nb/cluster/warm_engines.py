"""The kernel's warm process for this host's engines (``spec/warm_engines.py``).

Started the first time this kernel starts ranks on this host, it stays for the kernel's life:
the next start, restart or recovery forks its engines from it instead of starting each as a
new Python that imports torch (about 3 CPU-s per rank; a 2-rank start, one cell and a stop
take about a quarter of the CPU: ``benchmarks/forked_engines.py``). It holds no GPU (it
never touches CUDA) and no rank: ``cluster.stop()`` ends every engine as before. It ends
when the kernel does, SIGKILLed or not (it watches its parent), with any engine still running.

Ranks on other hosts, in a Slurm job, or with ``AXON_NB_WARM_ENGINES=0`` in the kernel's
environment start as new processes. Example::

    directory = server_directory()  # starts it on first use; None when engines start plain
    environment = {SERVER_ENV: directory} if directory else {}
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from axon_nb.spec.warm_engines import SWITCH_ENV, log_path, socket_path

SOCKET_WAIT_S = 10.0
"""How long a new server may take to listen before engines start without it."""

_lock = threading.Lock()
_server: subprocess.Popen[bytes] | None = None
_directory: str | None = None


def server_directory() -> str | None:
    """The running server's directory, started if needed; None when it is switched off or
    did not start (engines then start as new processes, as before)."""
    global _server, _directory
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    with _lock:
        if _server is not None and _server.poll() is None:
            return _directory
        if _directory is not None:
            shutil.rmtree(_directory, ignore_errors=True)
        _server, _directory = None, None
        directory = tempfile.mkdtemp(prefix="axon-engines-")  # owner-only
        try:
            with open(log_path(directory), "ab") as log:
                server = subprocess.Popen(
                    [sys.executable, "-m", "axon_nb.rank.world.engine_server", directory],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # the kernel's interrupts are not the engines'
                )
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)
            return None
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not os.path.exists(socket_path(directory)):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                server.wait()
                shutil.rmtree(directory, ignore_errors=True)
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


def running_directory() -> str | None:
    """The running server's directory without starting one (None if none runs)."""
    with _lock:
        if _server is not None and _server.poll() is None:
            return _directory
    return None
