"""Attaching a kernel to a detached cluster: connecting to its controller and ranks, and
finding a run any kernel started on it.

Example::

    cluster = axon_nb.attach("lab")          # Cluster.attach: this module's connect
    handle = cluster.handle("model")         # the whole run, streaming on
    result = handle.wait()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster import relay, startup
from axon_nb.errors import AxonError

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.train.handle import TrainHandle
    from axon_nb.train.kept_handle import KeptHandle


def connect(record: dict[str, Any], timeout: float) -> tuple[ipp.Cluster, ipp.Client]:
    """The ipyparallel cluster of ``record`` (from its file) and a client of its controller,
    with the ranks' relays registered for it."""
    cluster = ipp.Cluster.from_file(record["cluster_file"])
    cluster.shutdown_atexit = False
    cluster.log.disabled = True
    client = startup.connect_client(cluster, timeout)
    ranks = record["ranks"]
    targets = [r["rank"] for r in ranks]
    missing = sorted(set(targets) - set(client.ids))
    if missing:
        client.close()
        raise AxonError(f"ranks {missing} of {record['name']!r} are gone: stop it and start anew")
    # (from the record: a request to ranks that train would wait for the run's end)
    relay.register(client, {int(r): (host, address) for r, (host, address)
                            in record["relay"].items()})  # fmt: skip
    return cluster, client


def handle(cluster: ClusterLike, name: str) -> TrainHandle | KeptHandle:
    """Run ``name``: this kernel's latest run if it has that name, else on a detached cluster
    the run any kernel started, read from the cluster's directory."""
    own = cluster.last_run
    if own is not None and own.name == name:
        return own
    if cluster.detached is None:
        raise AxonError(
            f"no run named {name!r} in this kernel"
            + (f" (its latest is {own.name!r})" if own is not None else "")
            + "; runs of other kernels are found on detached clusters only"
        )
    from axon_nb.train.kept_handle import KeptHandle

    return KeptHandle.open(cluster, cluster.detached.root, name)
