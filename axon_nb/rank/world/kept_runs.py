"""(Rank) what a detached cluster's rank keeps in its run directory (``spec/kept_runs.py``):
everything it prints and, for each training run, every metrics publication and its summary,
so a kernel that attaches later finds the whole run.

``keep(root, rank)`` runs once, after the rank joined a detached cluster; ``train_on_rank``
then publishes through :func:`kept_sink` and ends with :func:`keep_end`. Example::

    keep("/run/user/.../axon-clusters/lab", rank=0)
    sink = kept_sink(publish_data, "model", run_id)
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from axon_nb.spec.kept_runs import (
    OUTPUT_LIMIT_BYTES,
    end_path,
    output_path,
    run_dir,
    stream_path,
    write_atomically,
)
from axon_nb.spec.processes import pid_alive

KEEPER_POLL_S = 1.0
"""How often a rank checks that its cluster's keeper still runs."""

_state: dict[str, Any] = {}
"""``root`` and ``rank`` once :func:`keep` ran on this rank."""


def keep(root: str, rank: int) -> None:
    """Keep this rank's output and runs under ``root`` from now on (again: nothing new)."""
    if _state.get("root") == root:
        return
    _state.update(root=root, rank=rank)
    path = output_path(root, rank)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    kept = _RotatingFile(path)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, TypeError):  # (a stream that is not ipykernel's)
            vars(stream)["write"] = _teeing(stream.write, kept)


def end_with(keeper_pid: int) -> None:
    """End this rank's process once the cluster's keeper process is gone (it may hold a GPU,
    and nothing would ever stop it); a thread polls every ``KEEPER_POLL_S``."""
    if _state.get("keeper") == keeper_pid:
        return
    _state["keeper"] = keeper_pid

    def watch() -> None:
        while pid_alive(keeper_pid):
            time.sleep(KEEPER_POLL_S)
        print(
            f"axon_nb: the cluster's keeper (pid {keeper_pid}) is gone; ending", file=sys.__stderr__
        )
        os._exit(1)

    threading.Thread(target=watch, name="axon-keeper-watch", daemon=True).start()


def kept_sink(
    sink: Callable[[dict[str, Any]], None], name: str, run: str, *, fresh: bool = True
) -> Any:
    """``sink`` (``publish_data``), and on a detached cluster (or in a job) each publication
    also appended to the run's stream file; ``fresh=False`` (a job resumed after preemption)
    appends to what the run kept before."""
    root = _state.get("root")
    if root is None:
        return sink
    (Path(root) / "runs").mkdir(mode=0o700, exist_ok=True)
    run_dir(root, name).mkdir(mode=0o700, exist_ok=True)
    path = stream_path(root, name, _state["rank"])
    if fresh and path.exists():  # (a run of the same name before: its stream is replaced)
        path.unlink()
    with contextlib.suppress(FileNotFoundError):
        end_path(root, name, _state["rank"]).unlink()
    path.touch(mode=0o600)  # (the run has begun here: kernels count it as running)

    def publish(message: dict[str, Any]) -> None:
        sink(message)
        try:
            with open(path, "a") as f:
                f.write(json.dumps(message, default=repr) + "\n")
        except (OSError, TypeError, ValueError) as e:  # (a full disk never stops the run)
            _warn(f"could not keep a publication of run {name!r}: {e}")

    return publish


def keep_end(name: str, summary: dict[str, Any]) -> None:
    """Keep this rank's summary of run ``name`` (what attaching kernels build the result from)."""
    root = _state.get("root")
    if root is None:
        return
    try:
        write_atomically(end_path(root, name, _state["rank"]), pickle.dumps(summary))
    except Exception as e:  # (never hides the run's own outcome)
        _warn(f"could not keep the summary of run {name!r}: {e}")


def _warn(text: str) -> None:
    print(f"axon_nb: {text}", file=sys.__stderr__, flush=True)


class _RotatingFile:
    """An append-only file rotated to ``.1`` once past ``OUTPUT_LIMIT_BYTES``."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._size = self._file.tell()

    def write(self, text: str) -> None:
        with self._lock:
            if self._size > OUTPUT_LIMIT_BYTES:
                self._file.close()
                os.replace(self._path, self._path.with_name(self._path.name + ".1"))
                self._file = open(self._path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
                self._size = 0
            self._file.write(text)
            self._file.flush()
            self._size += len(text)


def _teeing(write: Callable[[str], Any], kept: _RotatingFile) -> Callable[[str], Any]:
    def tee(text: str) -> Any:
        with contextlib.suppress(Exception):  # (a full disk never stops the rank's output)
            kept.write(text)
        return write(text)

    return tee
