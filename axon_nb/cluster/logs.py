"""Each cluster's log file: what its controller, MPI launcher and engines print, kept out of
the notebook and named by the errors that need it (a failed start, a dead rank).

Files live in ``$XDG_STATE_HOME/axon_nb/logs`` (``~/.local/state/axon_nb/logs``), owner-only
(directory 0700, files 0600); the newest :data:`KEEP` are kept, and never the log of a cluster
that may still run: one this process has not stopped, or one of another process still alive
(its name holds the pid of the process that started it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from axon_nb.cluster.stopping import alive

KEEP = 20
"""How many clusters' logs are kept (older ones are removed when a cluster starts)."""

CRASH_MARK = "Fatal Python error:"
"""How a rank's crash report begins (``faulthandler``, enabled in ``rank/world/engine.py``)."""
CRASH_LINES = 60
"""The most lines of a log an error shows from a crash report on."""

_OPEN: set[Path] = set()
"""The logs of this process's clusters that are not stopped yet."""


def log_dir() -> Path:
    """The owner-only directory of the clusters' logs (made on first use)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    path = Path(state) / "axon_nb" / "logs"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


class ClusterLog:
    """One cluster's log file and the logger that writes to it (never to the notebook).

    Example::

        log = ClusterLog.create()
        log.logger.warning("engine set stopped")
        print(log.tail(5))
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.logger = logging.getLogger(f"axon_nb.cluster.{path.stem}")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger.addHandler(self._handler)

    @classmethod
    def create(cls) -> ClusterLog:
        """A new, empty log file for a cluster starting now (older logs beyond KEEP go)."""
        directory = log_dir()
        _prune(directory)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = directory / f"cluster-{stamp}-{os.getpid()}-{time.monotonic_ns() % 10**6}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        _OPEN.add(path)
        return cls(path)

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the file (undecodable bytes replaced)."""
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def read_from(self, offset: int) -> tuple[str, int]:
        """What the file holds from byte ``offset`` on (undecodable bytes replaced), and
        where it ends: a poll reads only what was written since its last read."""
        offset = max(offset, 0)
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return "", offset
        return data.decode("utf-8", errors="replace"), offset + len(data)

    def ending(self, lines: int = 15) -> str:
        """The last ``lines`` non-blank lines and where the whole log is, to explain a
        failure; from the last crash report on instead (a rank's ``Fatal Python error`` and the
        stack it crashed in, up to :data:`CRASH_LINES`), where one is among them."""
        recent = [ln for ln in self.tail(200).splitlines() if ln.strip()]
        last = max(len(recent) - lines, 0)
        crashes = [i for i, ln in enumerate(recent) if ln.startswith(CRASH_MARK)]
        if crashes and crashes[-1] < last:  # the report, then the last lines after a gap
            report = recent[crashes[-1] : crashes[-1] + CRASH_LINES]
            gap = ["..."] if crashes[-1] + len(report) < last else []
            tail = report + gap + recent[max(last, crashes[-1] + len(report)) :]
        else:
            tail = recent[last:]
        return (
            f"The cluster's log ({self.path}) ends:\n" + "\n".join(tail)
            if tail
            else f"Log: {self.path}"
        )

    def close(self) -> None:
        """Stop writing (the file stays for the errors that named it)."""
        self.logger.removeHandler(self._handler)
        self._handler.close()
        _OPEN.discard(self.path)


def _prune(directory: Path) -> None:
    """Remove the oldest logs beyond ``KEEP - 1`` that belong to no running cluster. (An idle
    cluster writes nothing, so the oldest file may be the log of one still running: removed,
    its errors would name a file that is gone.)"""
    logs = sorted(_by_age(directory))
    excess = len(logs) - KEEP + 1
    for _, old in logs:
        if excess <= 0:
            break
        if _may_still_run(old):
            continue
        with contextlib.suppress(OSError):
            old.unlink()
        excess -= 1


def _by_age(directory: Path) -> list[tuple[float, Path]]:
    """Each log with its modification time. Other processes prune the same directory (every
    kernel that starts a cluster does), so a file listed here may be gone before its ``stat``;
    such a file is skipped."""
    found = []
    for path in directory.glob("cluster-*.log"):
        try:
            found.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    return found


def _may_still_run(path: Path) -> bool:
    """Whether the cluster that writes ``path`` may still be running."""
    if path in _OPEN:
        return True
    try:
        pid = int(path.name.split("-")[3])  # cluster-<date>-<time>-<pid>-<n>.log
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process's, and stopped (it is not open)
    return alive(pid)
