"""This host's rank processes while a cluster starts, found with few reads of ``/proc``.

Each local rank is a parent (``axon_nb.rank.world.launch``, below the MPI launcher) with one
child, its engine. ``wait_for_engines`` asks five times a second which of them are alive, for
as long as the engines take to register. Asking ``psutil`` for a process's children reads the
``stat`` file of every process on the host, so a 4-rank start on a host running a few hundred
processes read about a thousand files per poll: on two busy cores, seconds of the kernel's CPU
per start. Here the table is read once per poll, and only until every rank's parent and
engine are known; after that only those pids are checked.

Example::

    ranks = RankProcesses(lambda: [mpiexec.pid], n=2)
    parents, engines = ranks.poll()  # living rank parents, and the engines alive under them
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import psutil

from axon_nb.cluster.stopping import RANK_PARENT


class RankProcesses:
    """The rank parents below ``launchers()`` (pids of this host's MPI launchers) and their
    engines, for ``n`` ranks."""

    def __init__(self, launchers: Callable[[], list[int]], n: int) -> None:
        self._launchers = launchers
        self._n = n
        self._parents: list[int] = []  # in the order found
        self._engine_of: dict[int, int] = {}  # rank parent -> its engine
        self._found: dict[int, psutil.Process] = {}  # (is_running tells a reused pid apart)

    def poll(self) -> tuple[list[int], set[int]]:
        """The living rank parents, and the living engines whose parent lives."""
        if len(self._parents) < self._n or len(self._engine_of) < len(self._parents):
            self._scan()
        parents = [pid for pid in self._parents if self._alive(pid)]
        engines = {
            engine
            for parent, engine in self._engine_of.items()
            if parent in parents and self._alive(engine)
        }
        return parents, engines

    def _alive(self, pid: int) -> bool:
        try:
            proc = self._found.get(pid) or self._found.setdefault(pid, psutil.Process(pid))
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _scan(self) -> None:
        """One pass over the process table: new rank parents and engines below the launchers."""
        children: dict[int, list[int]] = {}
        for proc in psutil.process_iter(["ppid"]):
            ppid = proc.info["ppid"]
            if ppid:
                children.setdefault(ppid, []).append(proc.pid)
        below = [pid for pid in self._launchers() if pid]
        while below:
            pid = below.pop()
            for child in children.get(pid, []):
                if pid in self._parents:
                    if pid not in self._engine_of:
                        self._engine_of[pid] = child
                        self._remember(child)
                    continue
                # (a process not yet one may still exec into one: asked again next scan)
                if child not in self._parents and _is_rank_parent(child):
                    self._parents.append(child)
                    self._remember(child)
                below.append(child)

    def _remember(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self._found[pid] = psutil.Process(pid)


def _is_rank_parent(pid: int) -> bool:
    try:
        return RANK_PARENT in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
