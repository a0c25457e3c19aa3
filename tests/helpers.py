"""Helpers for tests: process liveness."""

from __future__ import annotations

import time

import psutil

import axon_nb


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


def engine_pids(cluster: axon_nb.Cluster) -> list[int]:
    return [r["pid"] for r in cluster.ranks]
