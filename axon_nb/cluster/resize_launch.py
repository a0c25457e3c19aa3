"""A resize's new ranks: a second launch beside the cluster's first ``mpiexec``, whose size
is fixed once it starts.

The new engines start as the first ones did (the same launcher, environment and warm
process), as an ``mpiexec`` of the new ranks alone (on one host: MPICH's gforker; across
hosts: hydra over ssh onto the added hosts' slots). Each asks the controller for the engine
id that is its rank in the new world (``rank/world/engine.py``: ``ID_BASE_ENV`` plus its rank
in this launch), so that engine ids stay the world's ranks. They join the world without MPI
(the kernel plans it, ``cluster/resize.py``); the cluster's reaper is replaced by one that
watches both launches. Example::

    launch = launch_ranks(cluster, 2, 4, ())     # engines 2 and 3 registered
    end_launch(cluster, launch, range(2, 4))    # (a failed resize) ended again
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from axon_nb.cluster import mpi_leftovers, reaper, stopping
from axon_nb.cluster.options import format_hosts
from axon_nb.errors import ClusterStartError
from axon_nb.spec.world_change import ID_BASE_ENV

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

POLL_S = 0.05
"""How often the kernel looks for the new engines' registrations."""


def launch_ranks(cluster: ClusterLike, old: int, n: int, added: tuple[tuple[str, int], ...]) -> str:
    """Start engines for ranks ``old .. n-1`` (on the ``added`` hosts' slots, across hosts)
    and wait for them to register; the launch's engine set id."""
    ipc = cluster._ipp
    assert ipc is not None
    config = ipc.config.MPIEngineSetLauncher
    options: dict[str, object] = {
        "environment": {**dict(config.environment), ID_BASE_ENV: str(old)}
    }
    if added:
        args = list(config.mpi_args)
        if "-hosts" not in args:
            raise ValueError("add_hosts starts ranks with MPICH's hydra mpiexec, not found here")
        args[args.index("-hosts") + 1] = format_hosts(added)
        options["mpi_args"] = args
    launch = ipc.start_engines_sync(n - old, **options)
    ipc.engines[launch].axon_ranks = range(old, n)  # (see ending_retired)
    _watch_every_launch(cluster)
    try:
        _wait_registered(cluster, launch, range(old, n))
    except BaseException:
        end_launch(cluster, launch, range(old, n))
        raise
    return str(launch)


def end_launch(cluster: ClusterLike, launch: str, ranks: range) -> None:
    """End a launch's engines (a resize that failed before the world changed)."""
    ipc = cluster._ipp
    if ipc is None or launch not in ipc.engines:
        return
    pids = stopping.launcher_pids_of(ipc.engines[launch])
    stopping.terminate_then_kill(stopping.process_tree(pids), pids, ranks_at_once=True)
    with contextlib.suppress(Exception):
        ipc.stop_engines_sync(launch)
    deadline = time.monotonic() + 10.0
    while set(ranks) & set(cluster.client.ids) and time.monotonic() < deadline:
        time.sleep(POLL_S)  # (the controller lets them go once their hearts stop)
    _watch_every_launch(cluster)


@contextlib.contextmanager
def ending_retired(cluster: ClusterLike, n: int) -> Iterator[None]:
    """After the block (which retires ranks ``n`` and up), end the later launches all of
    whose ranks retired: their ``mpiexec`` and its sleeping rank parents would otherwise
    stay until the cluster stops, one more set for every grow and shrink. Their MPI shared
    memory on this host, mapped by their ranks as the block begins, is unlinked."""
    ipc = cluster._ipp
    assert ipc is not None
    gone = {launch: s.axon_ranks for launch, s in ipc.engines.items()
            if getattr(s, "axon_ranks", range(0)).start >= n > 0}  # fmt: skip
    rows = [r for r in cluster.ranks if any(r["rank"] in span for span in gone.values())]
    with mpi_leftovers.removed_after(rows, "mpi"):
        yield
        for launch, span in gone.items():
            end_launch(cluster, launch, span)


def _watch_every_launch(cluster: ClusterLike) -> None:
    """A reaper for the controller and every launch (the kernel dying ends them all); the
    one it replaces is dismissed once the new one runs."""
    ipc = cluster._ipp
    assert ipc is not None and cluster._watch is not None
    previous = cluster._reaper
    cluster._reaper = reaper.spawn(
        os.getpid(), ipc.cluster_file, str(cluster._watch.path), stopping.launcher_pids(ipc)
    )
    if previous is not None:
        reaper.dismiss(previous)


def _wait_registered(cluster: ClusterLike, launch: str, ranks: range) -> None:
    """Until engines ``ranks`` have registered; fails once the launch has ended, an engine
    got another id, or the start timeout ran out."""
    ipc, client = cluster._ipp, cluster.client
    assert ipc is not None
    timeout = cluster.options.start_timeout
    deadline = time.monotonic() + timeout
    while not set(ranks) <= set(client.ids):
        strays = sorted(set(client.ids) - set(range(ranks.stop)))
        if strays:
            raise ClusterStartError(
                f"a new engine registered as {strays[0]}, not as one of ranks "
                f"{ranks.start}-{ranks.stop - 1}: its id was taken, or its MPI did not say "
                "its rank in the launch (PMI_RANK)"
            )
        launched = stopping.launcher_pids_of(ipc.engines[launch])
        if not all(stopping.alive(pid) for pid in launched):
            raise ClusterStartError(
                f"the new ranks' launch ended before they registered "
                f"({len(set(ranks) & set(client.ids))} of {len(ranks)} did); see the "
                f"cluster's log: {cluster.log.path if cluster.log else '(none)'}"
            )
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"only {len(set(ranks) & set(client.ids))} of {len(ranks)} new engines "
                f"registered within {timeout:g} s"
            )
        time.sleep(POLL_S)
