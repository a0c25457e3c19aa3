"""Shared-memory files that MPI jobs leave behind.

MPICH's ranks on one host share memory through a file ``/dev/shm/mpich_shm_*`` (2 MB for two
ranks), unlinked by ``MPI_Finalize``. A rank that is SIGKILLed (a dead rank, a stop that had to
kill, a kernel that was killed) leaves it there, and so does an engine forked by the warm
process, which ends with ``os._exit`` (``rank/world/engine_server.py``) and so never runs
mpi4py's finalizer, even on a clean stop: on a host that runs many jobs they pile up in memory.
A stop removes its own job's files on this host (:func:`removed_after`). Before it launches
ranks, a start removes the ones of this user that no process maps and that are older than
``STALE_S`` (a job starting right now maps its file within moments). Example::

    removed = remove_stale()  # ["/dev/shm/mpich_shm_71f5f796_0", ...]
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

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
    # A pooled or long-running cluster's file is a candidate at every start: the process seen
    # mapping it last time is asked first, and only files none explains cost a read of every
    # process's maps (torch processes have thousands of lines each).
    unexplained = [p for p in candidates if not _maps(_MAPPED_BY.get(p, 0), p)]
    mapped = _mapped_paths() if unexplained else {}
    removed = []
    for path in unexplained:
        if path not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


def mapped_by(pids: Iterable[int]) -> list[str]:
    """The MPICH shared-memory files that processes ``pids`` map now (a job's own, read while
    its ranks live)."""
    prefix = PATTERN.removesuffix("*")
    return sorted({path for pid in pids for path in _shm_paths(pid) if path.startswith(prefix)})


@contextlib.contextmanager
def removed_after(ranks: Iterable[Mapping[str, Any]], engines: str) -> Iterator[None]:
    """Unlink, once the block (which ends them) is over, the files that ``ranks`` (rows of
    ``Cluster.ranks``) on this host map as it begins; MPI engines only. A process that still
    maps one keeps its memory until it ends. Example::

        with removed_after(cluster.ranks, "mpi"):
            stopping.end_cluster(...)
    """
    here = socket.gethostname()
    paths = mapped_by(r["pid"] for r in ranks if r.get("host") == here) if engines == "mpi" else []
    try:
        yield
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


_MAPPED_BY: dict[str, int] = {}
"""For each file found mapped, the pid of a process that mapped it."""


def _maps(pid: int, path: str) -> bool:
    """True when process ``pid`` maps ``path``."""
    return pid > 0 and path in _shm_paths(pid)


def _mapped_paths() -> dict[str, int]:
    """Every ``/dev/shm`` path some process of this host maps (as far as /proc shows), each
    with one such pid (kept in ``_MAPPED_BY``)."""
    found: dict[str, int] = {}
    for maps in glob.glob("/proc/[0-9]*/maps"):
        pid = int(maps.split("/")[2])
        for path in _shm_paths(pid):
            found.setdefault(path, pid)
    _MAPPED_BY.clear()
    _MAPPED_BY.update(found)
    return found


def _shm_paths(pid: int) -> Iterator[str]:
    """The ``/dev/shm`` files process ``pid`` maps, one per mapping (none once it has ended)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as lines:
        for line in lines:
            if "/dev/shm/" in line:  # the file is the line's last field
                yield line.split(None, 5)[-1].strip().removesuffix(" (deleted)")
