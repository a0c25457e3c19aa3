"""Whether a process still runs, in plain Python (the ranks and the keeper's watchers use it)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs: it exists (another user's counts) and is no zombie.

    Example::

        pid_alive(os.getpid())   # True
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # (a zombie has ended, though not yet reaped)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
