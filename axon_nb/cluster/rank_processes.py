"""This host's rank processes while a cluster starts, found with few reads of ``/proc``.

Each local rank is a parent (``axon_nb.rank.world.launch``, below the MPI launcher) with one
engine: its child, or forked for it by this host's warm process (``spec/warm_engines.py``).
``wait_for_engines`` asks five times a second which of them are alive, for as long as the
engines take to register. Asking ``psutil`` for a process's children reads the
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

from axon_nb.cluster.stopping import forked_engine, is_rank_parent, running


class RankProcesses:
    """The rank parents below ``launchers()`` (pids of this host's MPI launchers) and their
    engines, for ``n`` ranks. Each is kept as the ``psutil.Process`` first found, so a pid
    reused by another process does not count as a living rank."""

    def __init__(self, launchers: Callable[[], list[int]], n: int) -> None:
        self._launchers = launchers
        self._n = n
        self._parents: dict[int, psutil.Process] = {}  # in the order found
        self._engines: dict[int, psutil.Process] = {}  # by the pid of their rank parent

    def poll(self) -> tuple[list[int], set[int]]:
        """The living rank parents, and the living engines whose parent lives."""
        if len(self._parents) < self._n or len(self._engines) < len(self._parents):
            self._scan()
        parents = [pid for pid, proc in self._parents.items() if running(proc)]
        engines = {
            engine.pid
            for parent, engine in self._engines.items()
            if parent in parents and running(engine)
        }
        return parents, engines

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
                if pid in self._parents:  # its one child, the engine
                    if pid not in self._engines:
                        with contextlib.suppress(psutil.Error):
                            self._engines[pid] = psutil.Process(child)
                    continue
                # (a process not yet one may still exec into one: asked again next scan)
                if child not in self._parents:
                    with contextlib.suppress(psutil.Error):
                        proc = psutil.Process(child)
                        if is_rank_parent(proc):
                            self._parents[child] = proc
                below.append(child)
        for pid, parent in self._parents.items():
            if pid not in self._engines and (engine := forked_engine(parent)) is not None:
                self._engines[pid] = engine
