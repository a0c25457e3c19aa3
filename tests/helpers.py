"""Helpers for tests: process liveness, waiting for a condition, Ctrl-C at the right moment."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

import axon_nb


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where one of these optional packages is missing (``make test`` installs them):
    found without importing them, so collecting the suite does not pay for their imports
    (peft's alone was 2 s in each pytest worker)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still alive after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cluster_pids() -> list[int]:
    """This process's descendants: its clusters' processes, their reaper, and the warm process
    their engines were forked from (``cluster/warm_engines.py``), which a stop ends too."""
    return [p.pid for p in psutil.Process().children(recursive=True)]


def engine_pids(cluster: axon_nb.Cluster) -> list[int]:
    return [r["pid"] for r in cluster.ranks]


def nannies(cluster: axon_nb.Cluster) -> list[psutil.Process]:
    """Each engine's nanny: its child in a session of its own (forked from the engine, or
    ipyparallel's new process)."""
    return [
        child for pid in engine_pids(cluster) for child in psutil.Process(pid).children()
        if os.getsid(child.pid) == child.pid
    ]  # fmt: skip


def until(check: Callable[[], Any], seconds: float = 60.0, every: float = 0.05) -> bool:
    """Call ``check`` every ``every`` s until it is true or ``seconds`` pass; whether it was."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def ctrl_c_when(check: Callable[[], Any], seconds: float = 60.0) -> threading.Event:
    """In a thread: Ctrl-C (SIGINT to this process, as Jupyter sends it to a kernel) once
    ``check`` is true, or after ``seconds`` at most. Setting the returned event calls it off."""
    off = threading.Event()

    def watch() -> None:
        until(lambda: off.is_set() or check(), seconds)
        if not off.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    return off


def fresh_world_sum() -> int:
    """(On every rank) forget the runs kept between calls; an all-reduce of ones. The pool's
    health check (conftest.py): it lives here, as the ranks import the module of a function
    they are sent, and conftest.py changes the environment of whatever imports it."""
    import torch
    import torch.distributed as dist

    from axon_nb.rank.training import trainstate

    for name in list(trainstate.runs()):
        trainstate.drop(name)

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())
