"""A rank's engine forked by this host's warm process (``rank/world/engine_server.py``),
handled by the rank's parent as it would handle a ``subprocess.Popen``.

The parent sends its command line, environment, working directory and every descriptor a
child of it would inherit (its output replaced by the engine's log), and keeps the connection
open: the server answers with the engine's pid and, once the engine has ended, its exit code
(negative: the signal that ended it). Closing the connection early (the parent died) makes
the server SIGKILL the engine, as a child of the parent would be. Example::

    engine = ForkedEngine.start(directory, [sys.executable, "-m", ENGINE_MODULE, "--mpi"], log)
    if engine is None:  # not an engine command, or no server answering: start it as a process
        ...
    code = engine.wait()
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

from axon_nb.spec.warm_engines import socket_path

ENGINE_MODULE = "axon_nb.rank.world.engine"

REPLY_WAIT_S = 120.0
"""How long to wait for the server to fork the engine (it imports torch first, once)."""


def _inherited_fds(skip: int) -> list[int]:
    """The descriptors a child of this process would inherit (``close_fds=False``)."""
    numbers = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != skip:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    numbers.append(fd)
    return sorted(numbers)


class ForkedEngine:
    """An engine the server forked for this process: ``pid``, ``returncode`` (None while it
    runs), ``wait()`` and ``send_signal()`` as on ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._replies = conn.makefile("rb")
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, directory: str, argv: list[str], output: int | None) -> ForkedEngine | None:
        """Ask the server in ``directory`` to fork ``argv`` (``python -m`` the engine module,
        with this interpreter), writing to ``output`` (None: this process's stdout and
        stderr); None when ``argv`` is another command or the server does not answer."""
        if argv[:3] != [sys.executable, "-m", ENGINE_MODULE]:
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(socket_path(directory))
            conn.settimeout(REPLY_WAIT_S)
            numbers = [0, 1, 2, *_inherited_fds(conn.fileno())]
            out = 1 if output is None else output
            err = 2 if output is None else output
            fds = [0, out, err, *numbers[3:]]
            request = {
                "args": argv[3:],
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "fd_numbers": numbers,
            }
            data = json.dumps(request).encode() + b"\n"
            sent = socket.send_fds(conn, [data], fds)
            conn.sendall(data[sent:])
            engine = cls(conn, -1)
            reply = engine._reply()
            if "pid" not in reply:
                raise ConnectionError("the server sent no pid")
            engine.pid = int(reply["pid"])
            conn.settimeout(None)
            return engine
        except (OSError, ValueError) as e:
            print(f"axon_nb: no forked engine ({e}); starting it as a process", file=sys.stderr)
            conn.close()
            return None

    def _reply(self) -> dict:
        line = self._replies.readline()
        return json.loads(line) if line else {}

    def wait(self) -> int:
        """Block until the engine has ended; its exit code (-N: ended by signal N; the
        server's death, which takes its engines along, reads as SIGKILL)."""
        if self.returncode is None:
            try:
                reply = self._reply()
            except (OSError, ValueError):
                reply = {}
            self.returncode = int(reply.get("exit", -9))
            self._replies.close()
            self._conn.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the engine while it runs."""
        if self.returncode is None:
            os.kill(self.pid, signum)
