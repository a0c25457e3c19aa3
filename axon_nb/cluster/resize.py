"""``cluster.resize(n)``: add or remove ranks of a live cluster, and carry a run in progress
over to the new world at a step boundary.

The steps, in order (each rank's part: ``rank/world/resize.py``):

1. Everything is checked first (:mod:`axon_nb.cluster.resize_checks`): the size, the
   hosts' devices, the run's layout and global batch on the new world. A refusal changes
   nothing.
2. A run in progress (``block=False``) stops at the next step boundary on every rank, as
   ``handle.stop()`` stops it; what it did is kept in its handle.
3. Growing: the new ranks' engines start in a second launch (``resize_launch.py``: an
   ``mpiexec`` of the new ranks alone, each engine asking for the id that is its rank) and
   register; every rank of the new world is probed and the world planned
   (``spec/world_change.py``). If any of this fails, the new engines are ended and the run
   goes on in the old world.
4. Every old rank leaves the old world together: the run is packed on rank 0
   (``rank/training/moved_run.py``); other runs, and objects ``%%axon`` cells built on the
   old process groups, are dropped and named.
5. The ranks removed retire (their engines exit; their parents keep the MPI slot); the ranks
   that stay and the new ones join the new world on a fresh rendezvous.
6. The new ranks open their relay; the cluster's ranks, options and relay routes become
   the new world's; every rank knows the run is pending.
7. The run goes on: ``train(resume=True)`` for the steps left, on the new world, which lays
   it out again and keeps its global batch; its handle, dashboard and trackers follow it.

Example::

    handle = cluster.train(model=make_model, data=ds, steps=1000, batch_size=32, block=False)
    cluster.resize(4)        # the run goes on with 4 ranks from its next step
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster import relay
from axon_nb.cluster.control import Control
from axon_nb.cluster.resize_checks import check_planned, check_resize, latest_run, running_run
from axon_nb.cluster.resize_launch import end_launch, ending_retired, launch_ranks
from axon_nb.cluster.sending import dispatch
from axon_nb.cluster.startup import bootstrap_spec, merged
from axon_nb.cluster.waiting import results, wait_for_ranks
from axon_nb.errors import AxonError, RankError
from axon_nb.rank import entry
from axon_nb.spec.placement import PlacementError, RankPlan
from axon_nb.spec.world_change import describe_change, hosts_after, plan_resize
from axon_nb.train.start import send_run

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.spec.train_spec import TrainSpec
    from axon_nb.train.handle import TrainHandle
    from axon_nb.train.result import TrainResult


def resize(
    cluster: ClusterLike, n: int | None = None, *, add_hosts: Any = None, keep: bool = True
) -> dict[str, Any]:
    """Make ``cluster`` a world of ``n`` ranks (``add_hosts``: the new ranks' ``(host,
    slots)`` on a cluster across hosts; ``n`` defaults to the ranks now plus those slots).
    A run in progress goes on in the new world from its next step; between runs, the latest
    one moves (``keep=False``: none does, every run on the ranks is dropped). What changed."""
    old = len(cluster.ranks)
    n, added = check_resize(cluster, n, add_hosts, keep)
    if n == old:
        print(f"The cluster already has {n} ranks; nothing changed.", file=sys.stderr)
        return {"from": old, "to": n, "seconds": 0.0}
    handle = running_run(cluster)
    kept = handle or (latest_run(cluster) if keep else None)
    started = time.monotonic()
    paused = handle._pause() if handle is not None else None
    launch = None
    try:
        if n > old:
            launch = launch_ranks(cluster, old, n, added)
        plans = _plan(cluster, n, kept._spec if kept is not None else None)
    except BaseException:
        if launch is not None:
            end_launch(cluster, launch, range(old, n))
        if handle is not None and paused is not None:
            _go_on(cluster, handle, paused, None)  # in the old world, as it was
        raise
    try:
        report = _change_world(cluster, kept.name if kept else None, plans, old, n, added)
    except BaseException as e:
        if handle is not None and paused is not None:
            handle._end_paused()  # (its result: what it did before the stop)
        cluster._broken = f"a resize from {old} to {n} ranks failed while the world changed"
        raise AxonError(
            f"the resize from {old} to {n} ranks failed while the ranks changed worlds ({e}); "
            "the cluster cannot go on as it is: `%axon_cluster --restart` (cluster.restart()) "
            "starts fresh ranks, and a checkpoint of the run loads there"
        ) from e
    record = {"step": paused.step if paused else None, "from": old, "to": n,
              "seconds": time.monotonic() - started}  # fmt: skip
    goes_on = handle is not None and paused is not None and _steps_left(handle, paused) > 0
    _say(record, report, kept.name if kept else None, goes_on)
    if handle is not None and paused is not None:
        _go_on(cluster, handle, paused, record)
    return {**record, **report}


def _plan(cluster: ClusterLike, n: int, kept: TrainSpec | None) -> list[RankPlan]:
    """Probe every rank of the new world and plan it (``spec/world_change.py``); the run
    that moves (``kept``) must fit the hosts as planned."""
    opts = cluster.options
    ipc = cluster._ipp
    watch = str(cluster._watch.path) if cluster._watch is not None else None
    spec = bootstrap_spec(opts, watch, (ipc.controller_ip if ipc is not None else None) or None)
    probes = cluster.control_call(
        entry.probe_for_resize, spec, ranks=list(range(n)), timeout=opts.start_timeout
    )
    current = {r["rank"]: str(r["device"]) for r in cluster.ranks if r["rank"] < n}
    try:
        plans = plan_resize(probes, current, backend=cluster.ranks[0]["backend"], gpus=opts.gpus)
    except PlacementError as e:
        raise ValueError(f"cannot resize to {n} ranks: {e}") from None
    if kept is not None:
        check_planned(kept, plans)
    return plans


def _change_world(
    cluster: ClusterLike,
    keep: str | None,
    plans: list[RankPlan],
    old: int,
    n: int,
    added: tuple[tuple[str, int], ...],
) -> dict[str, Any]:
    """Steps 4 to 6: leave the old world, retire the removed ranks, join the new one."""
    opts = cluster.options
    wait_s = opts.start_timeout + opts.timeout
    dask = cluster._dask.address is not None
    if dask:  # (its workers live on the ranks; cluster.dask() starts it again)
        cluster._dask.end(cluster)
        cluster._dask_rows = []
    left = cluster.control_call(entry.leave_for_resize, keep, ranks=list(range(old)),
                                timeout=wait_s)  # fmt: skip
    if n < old:
        with ending_retired(cluster, n):
            with contextlib.suppress(RankError):  # (an exit before its answer was out)
                cluster.control_call(entry.retire, ranks=list(range(n, old)), timeout=wait_s)
            cluster.ranks = cluster.ranks[:n]  # (from now on, their engines' exit is no death)
            _wait_unregistered(cluster.client, range(n, old), opts.start_timeout)
    summaries = _join(cluster, plans, min(old, n), f"store-resize-{uuid.uuid4().hex[:12]}")
    current = relay.relay_of(cluster.client)
    routes = {r: route for r, route in (current.routes if current else {}).items() if r < n}
    newcomers = list(range(old, n))
    if newcomers:
        addresses = cluster.control_call(entry.open_relay, ranks=newcomers, timeout=wait_s)
        routes.update({r: (summaries[r]["host"], a) for r, a in zip(newcomers, addresses,
                                                                   strict=True)})  # fmt: skip
    relay.reroute(cluster.client, routes)
    cluster.ranks = summaries
    cluster.options = dataclasses.replace(opts, n=n, hosts=hosts_after(opts.hosts, added))
    moved = any(report["moved"] for report in left)
    if moved and keep is not None:
        cluster.control_call(entry.hold_moved, keep, ranks=list(range(n)), timeout=wait_s)
    return {"moved": keep if moved else None, "runs": left[0]["runs"], "dask": dask,
            "objects": sorted({name for report in left for name in report["objects"]})}  # fmt: skip


def _join(
    cluster: ClusterLike, plans: list[RankPlan], stay: int, store: str
) -> list[dict[str, Any]]:
    """The ranks that stay rejoin and the new ones join, together (one rendezvous); their
    summaries in rank order."""
    client, opts = cluster.client, cluster.options
    watch = str(cluster._watch.path) if cluster._watch is not None else None
    ars = [dispatch(client, [p.rank], entry.rejoin, p, store) for p in plans[:stay]]
    ars += [dispatch(client, [p.rank], entry.join_world, p, opts.timeout, watch, store)
            for p in plans[stay:]]  # fmt: skip
    targets = [p.rank for p in plans]
    control = Control(client, targets)
    parts = wait_for_ranks(
        merged(client, ars, targets), targets, control=control, timeout=opts.start_timeout
    )
    return list(results(parts))


def _wait_unregistered(client: ipp.Client, ranks: range, timeout: float) -> None:
    """Until the controller has let the retired ranks' engines go (their ids are then free
    for a later resize's engines)."""
    deadline = time.monotonic() + timeout
    while set(ranks) & set(client.ids):
        if time.monotonic() > deadline:
            raise AxonError(f"the retired ranks {list(ranks)} did not leave within {timeout:g} s")
        time.sleep(0.05)


def _say(record: dict[str, Any], report: dict[str, Any], keep: str | None, goes_on: bool) -> None:
    """What the resize did, and what it dropped."""
    old, n = record["from"], record["to"]
    lines = [f"Resized the cluster from {old} to {n} ranks in {record['seconds']:.1f} s "
             f"({describe_change(old, n)})."]  # fmt: skip
    if report["moved"] and goes_on:
        lines.append(f"{keep!r} goes on from step {record['step']} on {n} ranks.")
    elif report["moved"]:
        lines.append(f"{keep!r} is laid out again on {n} ranks by its next "
                     "train(..., resume=True).")  # fmt: skip
    if report["runs"]:
        lines.append("Dropped the runs kept on the old world: " + ", ".join(report["runs"])
                     + " (cluster.save(path) before a resize keeps one).")  # fmt: skip
    if report["objects"]:
        lines.append("Dropped objects %%axon cells built on the old process groups: "
                     + ", ".join(report["objects"]) + " (build them again).")  # fmt: skip
    if report["dask"]:
        lines.append("The dask cluster on the ranks ended; cluster.dask() starts it again.")
    print(" ".join(lines), file=sys.stderr)


def _go_on(
    cluster: ClusterLike, handle: TrainHandle, paused: TrainResult, record: dict[str, Any] | None
) -> None:
    """The paused run trains on for the steps it had left (on the new world with ``record``,
    on the old one after a failed resize), or ends if it had finished."""
    left = _steps_left(handle, paused)
    if left <= 0:
        handle._end_paused()
        return
    going_on = dataclasses.replace(handle._spec, resume=True, steps=left)
    try:
        sent, run = send_run(cluster, going_on)
    except BaseException:
        handle._end_paused()
        raise
    handle._carry_on(sent, going_on, run, record)


def _steps_left(handle: TrainHandle, paused: TrainResult) -> int:
    """Steps the paused run had still to train (0 once it had finished)."""
    if not paused.stopped:
        return 0
    return paused.start_step + handle._spec.steps - paused.step
