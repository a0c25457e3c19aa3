"""The run directory of a detached cluster: what its ranks keep so that a kernel attaching
later finds the whole run (``axon_nb.attach``).

Layout, under the cluster's owner-only directory (``cluster/detached.py``)::

    runs/<name>/run.json          the kernel that started the run: run id, steps, ranks, pid,
                                  whether its ranks publish as they go (``streams``)
    runs/<name>/rank-<r>.jsonl    every metrics publication of rank r (axon_nb.metrics/1)
    runs/<name>/rank-<r>.end      rank r's summary (pickle), written once it returned
    output/rank-<r>.out           rank r's stdout and stderr (rotated to .out.1)

The ranks write (``rank/world/kept_runs.py``), kernels and the keeper read. Pure Python: both
sides and the keeper import it.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IN_FLIGHT_S = 30.0
"""A run whose ranks have not begun it this long after its kernel sent it never arrived (the
kernel died as it sent it): it no longer counts as running."""
OUTPUT_LIMIT_BYTES = 4 * 2**20
"""A rank's kept output file is rotated (to ``.out.1``, replacing the older one) past this."""


def run_dir(root: str | os.PathLike[str], name: str) -> Path:
    """The directory of run ``name`` (the ``name=`` of ``train``)."""
    return Path(root) / "runs" / name


def stream_path(root: str | os.PathLike[str], name: str, rank: int) -> Path:
    return run_dir(root, name) / f"rank-{rank}.jsonl"


def end_path(root: str | os.PathLike[str], name: str, rank: int) -> Path:
    return run_dir(root, name) / f"rank-{rank}.end"


def output_path(root: str | os.PathLike[str], rank: int) -> Path:
    return Path(root) / "output" / f"rank-{rank}.out"


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a reader never sees half of it; of
    writers at once, the last one's wins whole: each writes its own part file)."""
    writer = f"{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    part = path.with_name(f"{path.name}.{writer}.part")
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, path)


@dataclass(frozen=True)
class KeptRun:
    """One run as its directory tells it. Example::

    [run] = kept_runs(root)
    run.name, run.step, run.steps, run.running
    """

    name: str
    run: str
    """The run's id (a publication names it)."""
    steps: int
    strategy: str
    targets: list[int]
    kernel_pid: int
    step: int
    """The step rank ``targets[0]`` last published (0 before its first)."""
    ended: list[int]
    """Ranks whose summary is written."""
    running: bool
    """Some target has no summary yet and its process still runs."""
    started_at: float = 0.0

    def describe(self) -> str:
        state = "running" if self.running else "finished" if self.finished else "ended"
        return f"{self.name} (step {self.step} of {self.steps}, {state})"

    @property
    def finished(self) -> bool:
        return sorted(self.ended) == sorted(self.targets)


def read_run(root: str | os.PathLike[str], name: str, alive: dict[int, bool]) -> KeptRun | None:
    """Run ``name`` of ``root``; ``alive``: whether each rank's process runs."""
    try:
        started = json.loads((run_dir(root, name) / "run.json").read_text())
    except (OSError, ValueError):
        return None
    targets = list(started["targets"])
    ended = [r for r in targets if end_path(root, name, r).exists()]
    begun = any(stream_path(root, name, r).exists() for r in targets)  # (made as it begins)
    in_flight = time.time() - float(started.get("started_at", 0)) < IN_FLIGHT_S
    return KeptRun(
        name=name,
        run=started["run"],
        steps=int(started["steps"]),
        strategy=str(started.get("strategy", "")),
        targets=targets,
        kernel_pid=int(started["kernel_pid"]),
        step=last_step(stream_path(root, name, targets[0])),
        ended=ended,
        running=(begun or in_flight)
        and any(alive.get(r, False) for r in targets if r not in ended),
        started_at=float(started.get("started_at", 0)),
    )


def kept_runs(root: str | os.PathLike[str], alive: dict[int, bool]) -> list[KeptRun]:
    """Every run kept under ``root``, oldest first."""
    runs_dir = Path(root) / "runs"
    if not runs_dir.is_dir():
        return []
    found = [read_run(root, d.name, alive) for d in runs_dir.iterdir() if d.is_dir()]
    return sorted((r for r in found if r is not None), key=lambda r: r.started_at)


def last_step(path: Path) -> int:
    """The last step a rank's stream file records (reads only its last whole line)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            tail, size = b"", 65536
            while True:  # (a line holds the records since the last publication: may be long)
                start = max(0, end - size)
                f.seek(start)
                tail = f.read(end - start)
                lines = tail.rstrip(b"\n").split(b"\n")
                if len(lines) > 1 or start == 0:
                    break
                size *= 4
    except OSError:
        return 0
    try:
        return int(json.loads(lines[-1])["step"])
    except (ValueError, KeyError, TypeError):
        return 0


def read_end(root: str | os.PathLike[str], name: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s summary of run ``name`` (as ``entry.train`` returned it); a rank that
    failed kept ``{"error": (ename, evalue, traceback)}``. (Pickle: the file is in this user's
    owner-only directory, ``cluster/detached.py::clusters_dir`` checks it, and the ranks,
    this user's processes, wrote it.)"""
    with open(end_path(root, name, rank), "rb") as f:
        summary: dict[str, Any] = pickle.load(f)  # (owner-only directory: this user wrote it)
    return summary
