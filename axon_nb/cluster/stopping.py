"""Ending a cluster's processes on this host, whatever the ranks are doing: the SIGTERM and
SIGKILL steps of ``axon_nb.spec.stop_waits``, shared by ``Cluster.stop`` and the reaper.

The tree is collected before anything is signalled: once an engine's parent is gone its nanny
(in a session of its own) is re-parented and could no longer be found from the launcher.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterable
from typing import Any

import psutil

from axon_nb.spec.stop_waits import ASK_S, KILL_AFTER_S, LAUNCHER_GRACE_S
from axon_nb.spec.warm_engines import SERVER_ENV, forked_engine_pid

RANK_PARENT = "axon_nb.rank.world.launch"
"""The module each rank's parent runs (``rank/world/launch.py``); SIGTERM to it stops its rank."""


def alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(roots: Iterable[int]) -> list[psutil.Process]:
    """``roots`` and every process below them, as they are now (roots first); a rank's
    engine forked by the warm process (``spec/warm_engines.py``) counts as below its parent."""
    tree: list[psutil.Process] = []
    for pid in roots:
        try:
            root = psutil.Process(pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    for parent in [p for p in tree if is_rank_parent(p)]:
        engine = forked_engine(parent)
        if engine is not None:
            with contextlib.suppress(psutil.Error):
                tree += [engine, *engine.children(recursive=True)]
    return tree


def forked_engine(parent: psutil.Process) -> psutil.Process | None:
    """The engine this host's warm process forked for rank parent ``parent`` and still runs
    (the engine is the warm process's child), else None."""
    try:
        directory = parent.environ().get(SERVER_ENV)
        pid = forked_engine_pid(directory, parent.pid) if directory else None
        return psutil.Process(pid) if pid is not None else None
    except psutil.Error:
        return None


def wait_gone(procs: Iterable[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Wait up to ``seconds`` for ``procs`` to end; those still running. A zombie counts as
    ended (``psutil.wait_procs`` waits out its whole timeout on another process's zombie: a
    rank whose launcher has not reaped it yet)."""
    procs = list(procs)
    deadline = time.monotonic() + max(seconds, 0.0)
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def terminate_then_kill(
    tree: list[psutil.Process], roots: Iterable[int], *, ranks_at_once: bool = False
) -> list[int]:
    """SIGTERM the ``roots`` (the launchers) and the rank parents in ``tree``, wait
    ``KILL_AFTER_S``, SIGKILL the rest; the pids still running at the SIGKILL (empty when
    SIGTERM sufficed). ``ranks_at_once``: SIGKILL the engines (and nannies) right after their
    parents' SIGTERM, for a broken world, where busy survivors would only be waited out."""
    roots = set(roots)
    parents = [p for p in tree if p.pid in roots or is_rank_parent(p)]
    for proc in parents:
        _send(proc, signal.SIGTERM)
    if ranks_at_once:  # (after the parents' SIGTERM: they take the engines' end as the stop)
        for proc in tree:
            if proc not in parents:
                _send(proc, signal.SIGKILL)
    started = time.monotonic()
    below = [p for p in tree if p.pid not in roots]
    if below:
        # The ranks end by TERM_S (their parents SIGKILL them then); a launcher whose ranks
        # are gone has nothing left to wait for (MPI's waits out its own grace otherwise).
        wait_gone(below, KILL_AFTER_S)
        spent = time.monotonic() - started
        grace = 0.0 if all(_is_forker(p) for p in tree if running(p)) else LAUNCHER_GRACE_S
        left = wait_gone(tree, min(grace, max(0.0, KILL_AFTER_S - spent)))
    else:
        left = wait_gone(tree, KILL_AFTER_S)
    for proc in left:
        _send(proc, signal.SIGKILL)
    wait_gone(left, 2.0)
    return [p.pid for p in left]


def _is_forker(proc: psutil.Process) -> bool:
    """True for MPICH's one-host launcher, ``mpiexec.gforker``. It takes the first of its
    ranks to exit for a failed one (whatever its exit code), interrupts the others, sleeps a
    second and only then exits; SIGTERM it only passes on to its ranks. Once they are gone it
    has nothing left to do anywhere, so it gets no grace (hydra, whose proxies may run on
    other hosts, does)."""
    try:
        return proc.name() == "mpiexec.gforker"
    except psutil.Error:
        return False


def is_rank_parent(proc: psutil.Process) -> bool:
    """True when ``proc`` runs ``RANK_PARENT`` (false once it has ended)."""
    try:
        return RANK_PARENT in proc.cmdline()
    except psutil.Error:
        return False


def running(proc: psutil.Process) -> bool:
    """True while ``proc`` runs: not a zombie, and not another process with its pid."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error, ProcessLookupError):
        if proc.is_running():
            proc.send_signal(sig)


def launcher_pids(ipp_cluster: Any, *, engines: bool = True, controller: bool = True) -> list[int]:
    """Pids of the processes an ``ipyparallel.Cluster`` started: the engine launchers
    (``mpiexec``, or each local engine's parent) and the controller."""
    pids = [
        p for s in (ipp_cluster.engines.values() if engines else []) for p in launcher_pids_of(s)
    ]
    if controller and ipp_cluster.controller is not None:
        pids += _pids([ipp_cluster.controller])
    return pids


def launcher_pids_of(engine_set: Any) -> list[int]:
    """Pids of one engine set's launchers (a local engine set is one launcher per engine;
    an MPI set is one ``mpiexec``; a resize adds a set)."""
    return _pids(getattr(engine_set, "launchers", {}).values() or [engine_set])


def _pids(launchers: Any) -> list[int]:
    return [
        launcher.process.pid
        for launcher in launchers
        if getattr(launcher, "process", None) is not None
    ]


def end_cluster(ipp_cluster: Any, client: Any, *, ask: bool, busy: bool = False) -> None:
    """End every process of ``ipp_cluster``, engines first, by the steps of ``stop_waits``:
    with ``ask`` and idle engines, a shutdown request through ``client`` first (a busy engine
    acts on it only when its cell ends: ``busy`` says the ranks run work ``client`` did not
    send, as another kernel's run on a detached cluster, and skips it). Without ``ask`` (a
    rank died: survivors may be stuck in collectives, and nothing on a broken world is kept)
    the engines are SIGKILLed at once."""
    engines = launcher_pids(ipp_cluster, controller=False)
    tree = process_tree(engines)
    if ask and not busy and client is not None:
        with contextlib.suppress(Exception):
            if not client.outstanding:
                client.shutdown(targets="all", block=False)
                # The engines (and their nannies) act on it; the parent of a rank that died
                # stays until signalled, so the rest of the tree gets only a short grace.
                asked = [p for p in tree if p.pid not in engines and not is_rank_parent(p)]
                wait_gone(asked, ASK_S)
                # their parents exit with them (a rank parent may be a launcher itself, as
                # with local engines); the other launchers are seen to below
                wait_gone(
                    [p for p in tree if p.pid not in engines or is_rank_parent(p)],
                    LAUNCHER_GRACE_S,
                )
    terminate_then_kill(tree, engines, ranks_at_once=not ask)  # (at once if all are gone)
    controller = launcher_pids(ipp_cluster, engines=False)
    terminate_then_kill(process_tree(controller), controller)
    forget_launchers(ipp_cluster)


def forget_launchers(ipp_cluster: Any) -> None:
    """ipyparallel's record of processes ended here goes: their output files and the
    cluster file are removed, and its exit handler has nothing left to stop. A batch job's
    engines (Slurm's) are ended by ipyparallel (``scancel``). Ending the local ones through
    ``stop_cluster`` instead would signal each again and wait, in a thread of its own, for
    its watchers to notice: one to two seconds more per stop."""
    from ipyparallel.cluster.launcher import BatchSystemLauncher

    for set_id, engine_set in list(ipp_cluster.engines.items()):
        if isinstance(engine_set, BatchSystemLauncher):
            # (it forgets the set once cancelled; one it could not cancel stays, for its
            # exit handler to try again, with the cluster file)
            with contextlib.suppress(Exception):
                ipp_cluster.stop_engines_sync(set_id)
            continue
        with contextlib.suppress(Exception):
            engine_set.get_output(remove=True)
        ipp_cluster.engines.pop(set_id, None)
    if ipp_cluster.controller is not None:
        with contextlib.suppress(Exception):
            ipp_cluster.controller.get_output(remove=True)
    ipp_cluster.controller = None
    if not ipp_cluster.engines:
        with contextlib.suppress(Exception):
            ipp_cluster.remove_cluster_file()
