"""What ``cluster.resize`` refuses, checked before anything changes: a size that is not a
positive integer, a cluster it cannot grow (detached, not started by ``mpiexec``), new ranks
beyond this host's devices or cores (without ``oversubscribe``) or without hosts to go to,
and a run whose layout or global batch does not fit the new world, whose data a resize cannot
keep in order, or whose strategy keeps state a resize does not carry. Example::

    n, added = check_resize(cluster, 4, None)   # ValueError, saying what to change
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from axon_nb.cluster.host_fit import check_fits_here
from axon_nb.cluster.options import format_hosts, parse_hosts
from axon_nb.errors import ClusterStartError
from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.validation import check_world

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.spec.placement import RankPlan
    from axon_nb.spec.train_spec import TrainSpec
    from axon_nb.train.handle import TrainHandle

Hosts = tuple[tuple[str, int], ...]


def latest_run(cluster: ClusterLike) -> TrainHandle | None:
    """The latest run this kernel started on these ranks (not on ranks a restart replaced)."""
    handle = cluster.last_run
    return handle if handle is not None and handle.ran_on(cluster.client) else None


def running_run(cluster: ClusterLike) -> TrainHandle | None:
    """The run this kernel started that is still training (``block=False``), if any."""
    handle = latest_run(cluster)
    return handle if handle is not None and not handle.done else None


def check_resize(
    cluster: ClusterLike, n: int | None, add_hosts: Any, keep: bool = True
) -> tuple[int, Hosts]:
    """The new size and the added ``(host, slots)``, or ``ValueError`` saying what to change."""
    cluster.targets()  # a cluster that runs and is not broken
    opts = cluster.options
    old = len(cluster.ranks)
    added = _hosts(add_hosts)
    if n is None:
        if not added:
            raise ValueError("resize needs the new number of ranks (or add_hosts=): resize(4)")
        n = old + sum(slots for _, slots in added)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {n!r}")
    if opts.detach:
        raise ValueError(
            "a detached cluster cannot be resized yet (its keeper watches the ranks it "
            "started): stop it and start one of the size you want, or use an attached one"
        )
    if opts.engines != "mpi":
        raise ValueError(
            f"resize starts and ends ranks with mpiexec: a cluster of --engines {opts.engines} "
            f"cannot be resized; cluster.restart(n={n}) starts {n} fresh ranks"
        )
    _check_hosts(cluster, n, old, added)
    _check_runs(cluster, n, keep)
    return n, added


def _hosts(add_hosts: Any) -> Hosts:
    if add_hosts is None:
        return ()
    if isinstance(add_hosts, str):
        return parse_hosts(add_hosts)
    try:
        hosts = tuple((str(host), int(slots)) for host, slots in add_hosts)
    except (TypeError, ValueError):
        raise ValueError(
            f"add_hosts must be (host, slots) pairs or 'host:slots,...', got {add_hosts!r}"
        ) from None
    if any(slots < 1 for _, slots in hosts):
        raise ValueError(f"add_hosts gives each host at least one slot, got {add_hosts!r}")
    return hosts


def _check_hosts(cluster: ClusterLike, n: int, old: int, added: Hosts) -> None:
    """Where the new ranks go: this host (within its devices), or the added hosts' slots."""
    opts = cluster.options
    if added:
        if opts.hosts is None or len({r["host"] for r in cluster.ranks}) < 2:
            raise ValueError(
                "add_hosts (--add-host) grows a cluster across hosts: its ranks must be on two "
                "hosts or more now (start with --hosts a:1,b:1), so that its controller and "
                "rendezvous listen on the hosts' network; this one's ranks meet on one host"
            )
        slots = sum(count for _, count in added)
        if n != old + slots:
            raise ValueError(
                f"a resize from {old} to {n} ranks starts {n - old} new ones, but add_hosts "
                f"{format_hosts(added)} gives {slots} slots: give as many slots as new ranks"
            )
        return
    if n > old and opts.hosts is not None:
        raise ValueError(
            f"a cluster across hosts grows onto hosts you name: resize({n}, add_hosts="
            f"'host:{n - old}') (%axon_cluster --resize {n} --add-host host:{n - old})"
        )
    if n > old:
        try:
            check_fits_here(dataclasses.replace(opts, n=n), running=old)
        except ClusterStartError as e:
            raise ValueError(f"cannot resize to {n} ranks: {e}") from None


def _check_runs(cluster: ClusterLike, n: int, keep: bool) -> None:
    """The run that moves must fit the new world (the one in progress, else the latest)."""
    handle = running_run(cluster)
    if handle is not None and not keep:
        raise ValueError(
            f"{handle.name!r} is training: keep=False would drop it mid-run. Stop it first "
            "(handle.stop()), or resize with it (keep=True) to go on in the new world"
        )
    kept = handle or (latest_run(cluster) if keep else None)
    if kept is None:
        return
    spec = kept._spec
    per_host = n if cluster.options.hosts is None else cluster.ranks_per_host
    try:
        check_world(spec, n, per_host)
    except ValueError as e:
        raise ValueError(
            f"cannot resize to {n} ranks: {spec.name!r} ({spec.strategy.describe()}, "
            f"batch_size={spec.batch_size}) moves with the resize and would not fit: {e}. "
            "The cluster is unchanged"
            + ("" if handle else "; resize(n, keep=False) drops the runs on the ranks instead")
        ) from None
    config = spec.strategy.config()
    if config.diloco is not None or config.async_sgd is not None:
        raise ValueError(
            f"{spec.name!r} trains with {spec.strategy.describe()}, whose own state (the "
            "outer loop, gradients in flight) a resize does not carry: save a checkpoint "
            "(cluster.save), resize, and load it (cluster.load). The cluster is unchanged"
        )
    if handle is not None:
        _check_data(spec)


def check_planned(spec: TrainSpec, plans: list[RankPlan]) -> None:
    """The run that moves, against the world as planned (its hosts known once probed): it
    fits rank 0's host's ranks, and every rank lays it out alike, whatever its host holds."""
    n = len(plans)
    per_host = sorted({p.local_world_size for p in plans})
    try:
        check_world(spec, n, plans[0].local_world_size)
        layouts = [spec.strategy.dims(n, count) for count in per_host]
    except ValueError as e:
        raise ValueError(f"cannot resize to {n} ranks: {spec.name!r} would not fit: {e}") from None
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(
            f"cannot resize to {n} ranks: its hosts would hold {per_host} ranks, and "
            f"{spec.name!r}'s layout ({spec.strategy.describe()}) depends on the ranks per "
            "host; give every host as many ranks (add_hosts). The cluster is unchanged"
        )


def _check_data(spec: TrainSpec) -> None:
    """A run in progress goes on in the same global order only over map-style data."""
    data = spec.data
    stream = any(c.__name__ == "IterableDataset" for c in type(data).__mro__)
    if is_dask_data(data) or stream:
        what = "a dask collection, whose pieces sit on their ranks" if not stream else "a stream"
        raise ValueError(
            f"{spec.name!r} reads {what}: a resize in the middle of it cannot keep its order "
            "exact. Stop the run (handle.stop()), resize, and go on with "
            "train(..., resume=True, data=...) from a fresh pass. The cluster is unchanged"
        )
