"""Engines forked from a warm process: what the kernel, a rank's parent and the server agree on.

A rank's engine spends most of its start importing torch. On one host, the kernel starts one
warm process (``rank/world/engine_server.py``) the first time it starts ranks; it imports what
an engine imports, once, and forks each rank's engine on its parent's request
(``rank/world/forked_engine.py``). Everything lives in one private directory, whose path the
ranks' environment carries in :data:`SERVER_ENV`:

- ``engines.sock``: the Unix socket a rank's parent connects to;
- ``engines/<parent pid>``: the pid of the engine forked for that rank's parent, while it runs
  (the engine is the server's child, not its parent's: the kernel finds it here);
- ``server.log``: the server's own output.

Example::

    engine_pid = forked_engine_pid("/tmp/axon-engines-x1y2", parent_pid=4242)  # None if none
"""

from __future__ import annotations

import contextlib
import os

SERVER_ENV = "AXON_NB_ENGINE_SERVER"
"""The server's directory, in the ranks' environment (absent: engines start as new processes)."""

SWITCH_ENV = "AXON_NB_WARM_ENGINES"
"""Set to ``0`` in the kernel's environment to start every engine as a new process."""


def socket_path(directory: str) -> str:
    """The socket a rank's parent asks the server on."""
    return os.path.join(directory, "engines.sock")


def engines_dir(directory: str) -> str:
    """Where the server records which engine it forked for which rank's parent."""
    return os.path.join(directory, "engines")


def log_path(directory: str) -> str:
    """The server's own output (an engine writes to its rank's log, as any engine does)."""
    return os.path.join(directory, "server.log")


def forked_engine_pid(directory: str, parent_pid: int) -> int | None:
    """The engine the server forked for ``parent_pid`` and still runs, else None."""
    record = os.path.join(engines_dir(directory), str(parent_pid))
    with contextlib.suppress(OSError, ValueError), open(record) as f:
        return int(f.read())
    return None
