"""Shared-memory files that MPI jobs ended by SIGKILL leave behind.

MPICH's ranks on one host share memory through a file ``/dev/shm/mpich_shm_*``, unlinked
when the job finishes cleanly. A rank that is SIGKILLed (a dead rank, a stop that had to
kill, a kernel that was killed) leaves it there, and on a host that runs many jobs they pile
up in memory. Before it launches ranks, a start removes the ones of this user that no process
maps and that are older than ``STALE_S`` (a job starting right now maps its file within
moments). Example::

    removed = remove_stale()  # ["/dev/shm/mpich_shm_71f5f796_0", ...]
"""

from __future__ import annotations

import contextlib
import glob
import os
import time

PATTERN = "/dev/shm/mpich_shm_*"
STALE_S = 120.0
"""A file this old that no process maps belongs to no job."""


def remove_stale(now: float | None = None) -> list[str]:
    """Remove this user's stale MPICH shared-memory files; the paths removed."""
    now = time.time() if now is None else now
    candidates = []
    for path in glob.glob(PATTERN):
        with contextlib.suppress(OSError):
            info = os.stat(path)
            if info.st_uid == os.getuid() and now - info.st_mtime > STALE_S:
                candidates.append(path)
    if not candidates:
        return []
    mapped = _mapped_paths()
    removed = []
    for path in candidates:
        if path not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


def _mapped_paths() -> set[str]:
    """Every ``/dev/shm`` path some process of this host maps (as far as /proc shows)."""
    found: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as lines:
            for line in lines:
                if "/dev/shm/" in line:
                    found.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
    return found
