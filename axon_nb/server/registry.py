"""The Jupyter server's view of the kernels' clusters: the state files that
``axon_nb.cluster.lab_registry`` writes, and the control files it reads.

Only entries whose kernel process is alive and that were rewritten in the last
``STALE_S`` seconds are listed, so a kernel that dies or a cluster that stops leaves the list
within seconds. The directory must be this user's and owner-only; otherwise nothing is
listed and nothing is written (someone else could be feeding it).

Example::

    list_clusters()                     # [{"key": ..., "ranks": 2, "run": {...}}, ...]
    request("k1-ab12cd34", "stop_run")  # the kernel carries it out within a second
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from axon_nb.spec.lab_protocol import ACTIONS, registry_path

STALE_S = 5.0
"""An entry not rewritten for this long is gone (its kernel is stuck or dead)."""
KEY = re.compile(r"[A-Za-z0-9_-]+")


class RegistryError(Exception):
    """A request the registry cannot take; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def checked_dir() -> Path | None:
    """The registry directory (None before any kernel made one), refused unless this user
    owns it and only this user can enter it. The server checks it; it never loosens or
    fixes it."""
    path = registry_path()
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise RegistryError(
            500,
            f"{path} is not owner-only (it must belong to uid {os.getuid()} with mode 0700); "
            "fix its owner and mode (chmod 700), then reload",
        )
    return path


def list_clusters(now: float | None = None) -> list[dict[str, Any]]:
    """Every live cluster's state, sorted by key."""
    directory = checked_dir()
    if directory is None:
        return []
    now = time.time() if now is None else now
    found = []
    for path in sorted(directory.glob("cluster-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now, or not ours
            continue
        if _live(state, now):
            found.append(state)
    return found


def get_cluster(key: str) -> dict[str, Any]:
    """One live cluster's state (``RegistryError`` 404 when there is none)."""
    for state in list_clusters():
        if state.get("key") == key:
            return state
    raise RegistryError(404, f"no running cluster {key!r}: it stopped, or its kernel is gone")


def request(key: str, action: str) -> Path:
    """Ask the kernel of cluster ``key`` to carry out ``action``; the control file written."""
    if action not in ACTIONS:
        raise RegistryError(400, f"unknown action {action!r}: use one of {', '.join(ACTIONS)}")
    if not KEY.fullmatch(key):
        raise RegistryError(400, f"a cluster key has only letters, digits, _ and -; got {key!r}")
    get_cluster(key)
    directory = checked_dir()
    assert directory is not None  # (the cluster was found in it)
    name = f"control-{key}-{uuid.uuid4().hex}"
    partial = directory / f"{name}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"action": action, "requested": time.time()}, f)
    final = directory / f"{name}.json"
    os.replace(partial, final)
    return final


def _live(state: dict[str, Any], now: float) -> bool:
    try:
        pid, updated = int(state["pid"]), float(state["updated"])
    except (KeyError, TypeError, ValueError):
        return False
    if now - updated > STALE_S:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's: not ours to show
        return False
    return True
