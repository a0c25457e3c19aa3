"""What a cluster's processes listen on, in one line (``Cluster.exposure``, ``%axon_cluster``)."""

from __future__ import annotations

from typing import Any

from axon_nb.cluster.options import ClusterOptions


def describe_exposure(
    options: ClusterOptions, ranks: list[dict[str, Any]], controller: str | None, dask: Any
) -> str:
    """One line for a cluster with these ``options`` and rank summaries, its controller's
    address and its dask client (None without one). Example::

        describe_exposure(ClusterOptions(n=2), ranks, "127.0.0.1", None)
        # 'Listening on loopback only: ...'
    """
    if not ranks:
        return "Not running: nothing listens."
    stores = {r.get("store", "") for r in ranks}
    also = (
        " The dask scheduler (cluster.dask()) binds the controller's address and each rank's "
        "worker its own, TLS with the cluster's certificates; their HTTP servers loopback."
        if dask is not None
        else ""
    )
    guard = " ipyparallel's sockets use CurveZMQ and HMAC; every port: axon_nb.cluster.ports."
    if not options.multi_host:
        return (
            "Listening on loopback only: the controller, MPI and gloo bind 127.0.0.1, and the "
            "ranks meet through a store file in an owner-only directory." + also + guard
        )
    return (
        f"Listening on the ranks' network: the controller on {controller or '?'}, the "
        f"rendezvous store on {', '.join(sorted(stores))}, gloo and MPI on each rank's "
        "address; also hydra's mpiexec on every interface of this host (MPICH cannot narrow "
        "it)." + also + guard
    )
