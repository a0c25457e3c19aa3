"""``cluster.dask()``: a dask cluster whose workers are the ranks themselves.

The scheduler runs in the ipyparallel controller (what ``ipyparallel.Client.become_dask``
asks it for) and binds the controller's address: loopback on one host, the ranks' network
across hosts. Each rank's engine runs one worker (``axon_nb.rank.data.dask_worker``) on its own
address toward the scheduler, so dask work (reading files, filtering, featurizing) runs on
the ranks' cores and memory, and what a rank computes for training stays in its process.

Every connection is TLS with the cluster's own certificates (``cluster/dask_tls.py``): a
client without them is refused. dask's HTTP servers serve no route (their ``http.routes`` are
emptied in the controller's and workers' settings) and listen on loopback only; the
scheduler's dashboard is served only when asked for (``cluster.dask(dashboard=True)``), on
loopback.

Stopped with the cluster; after a restart (fresh ranks, fresh controller) the next call makes
a new one.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from axon_nb.cluster.dask_tls import cluster_tls
from axon_nb.errors import AxonError
from axon_nb.rank import entry

if TYPE_CHECKING:
    import distributed
    import ipyparallel as ipp

    from axon_nb.cluster.hangs import WatchDir
    from axon_nb.cluster.transport import ClusterLike

WORKER_TTL_S = 30 * 24 * 3600
"""A rank's worker shares the engine's event loop, which waits while the rank runs a cell (a
training run can take hours): the scheduler must not drop it for missing heartbeats then.
A worker that really dies is still noticed at once, by its closed connection."""
START_TIMEOUT_S = 60


class DaskOnRanks:
    """The distributed client of one axon_nb cluster, made on first use."""

    def __init__(self) -> None:
        self.client: distributed.Client | None = None
        self.workers: dict[int, str] = {}
        """Rank -> its worker's address."""
        self.dashboard: str | None = None
        """The dashboard's address when it is served (``cluster.dask(dashboard=True)``)."""
        self.address: str | None = None
        """The scheduler's address, once the controller runs one."""
        self._security: distributed.Security | None = None
        """The client's credentials, kept in memory: a scheduler can still be shut down after
        a certificate file went missing."""

    def ensure(
        self,
        cluster: ClusterLike,
        private: WatchDir | None,
        controller: ipp.Cluster | None,
        *,
        dashboard: bool = False,
    ) -> distributed.Client:
        """The client, started now if there is none or the ranks changed since (or the
        dashboard is asked for and not on), its certificates in the cluster's owner-only
        directory ``private``, its scheduler in the ipyparallel ``controller``. On any failure,
        no scheduler or worker is left running."""
        if private is None:
            raise AxonError("the cluster is not running: start it before cluster.dask()")
        tls = cluster_tls(private.path)
        wanted = self.dashboard is not None or not dashboard
        if self.client is not None and self._serves(cluster) and wanted:
            return self.client
        try:
            tls.ensure()  # (a file gone missing: raised before anything starts)
        except BaseException:
            self.end(cluster)
            raise
        if dashboard and self.address is not None:
            self.end(cluster)  # the controller keeps its scheduler: a new one, with a dashboard
        self.close()
        self._security = tls.security("client")
        try:
            self.address = _start_scheduler(cluster, _scheduler_host(controller), dashboard)
            cluster.run(entry.start_dask_worker, self.address, tls.pem("worker"), stream=False)
            self.client = _connect(self.address, self._security, len(cluster.ranks))
        except BaseException:
            self.end(cluster)
            raise
        self.workers = workers_by_rank(self.client)
        self.dashboard = self.client.dashboard_link if dashboard else None
        print(self.describe(), flush=True)
        return self.client

    def describe(self) -> str:
        """One line: where the scheduler listens, how it is protected, and the dashboard."""
        if self.client is None:
            return "dask: not started (cluster.dask() starts it)"
        where = (
            f"dashboard on {self.dashboard} (loopback only)"
            if self.dashboard
            else "dashboard off (cluster.dask(dashboard=True) serves it on loopback)"
        )
        return (
            f"dask: scheduler {self.address}, TLS with this cluster's certificates (clients "
            f"without them are refused); {where}"
        )

    def close(self) -> None:
        """Close the client (the workers and scheduler end with the ranks and controller)."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=5)
        self.client = None
        self.workers = {}
        self.dashboard = None

    def forget(self) -> None:
        """Close the client of a cluster that stops (its scheduler and workers end with it)."""
        self.close()
        self.address = None
        self._security = None

    def end(self, cluster: ClusterLike) -> None:
        """Close the client, and end the ranks' workers and the controller's scheduler."""
        self.close()
        with contextlib.suppress(Exception):
            cluster.run(entry.stop_dask_worker, stream=False)
        if self.address is not None and self._security is not None:
            _shut_down_scheduler(cluster, self.address, self._security)
        self.address = None

    def _serves(self, cluster: ClusterLike) -> bool:
        if self.client is None or self.client.status != "running":
            return False
        with contextlib.suppress(Exception):
            return workers_by_rank(self.client) == self.workers and len(self.workers) == len(
                cluster.ranks
            )
        return False


def _scheduler_host(controller: ipp.Cluster | None) -> str:
    if controller is None:
        raise AxonError("the cluster is not running: start it before cluster.dask()")
    return controller.controller_ip or "127.0.0.1"


def _start_scheduler(cluster: ClusterLike, host: str, dashboard: bool) -> str:
    """Ask the controller to run a dask scheduler on ``host``, over TLS (its certificates
    come from the controller's environment, ``dask_tls.scheduler_environment``); its address.

    This is the request ``ipyparallel.Client.become_dask`` sends before it starts workers
    with one set of arguments for every engine; here each rank's worker binds its own address.
    The HTTP server, which dask starts either way, listens on loopback.
    """
    client = cluster.client
    reply = client._send_recv(
        client._query_stream,
        "become_dask_request",
        {
            "scheduler_args": {
                "host": host,
                "protocol": "tls",
                "dashboard": dashboard,
                "dashboard_address": "127.0.0.1:0",
                "worker_ttl": WORKER_TTL_S,
            }
        },
    )
    if reply["content"]["status"] != "ok":
        raise AxonError(f"the controller could not start a dask scheduler: {reply['content']}")
    return str(reply["content"]["address"])


def _connect(address: str, security: distributed.Security, n: int) -> distributed.Client:
    """The kernel's client, once all ``n`` workers have joined."""
    import distributed

    client = distributed.Client(
        address, security=security, timeout=START_TIMEOUT_S, set_as_default=True
    )
    try:
        client.wait_for_workers(n, timeout=START_TIMEOUT_S)
    except BaseException:
        client.close()
        raise
    return client


def _shut_down_scheduler(
    cluster: ClusterLike, address: str, security: distributed.Security
) -> None:
    """End the controller's scheduler and have the controller forget it, so that the next
    ``cluster.dask()`` starts a new one (ipyparallel's own ``stop_distributed`` does not
    await dask's asynchronous ``close``, so the scheduler would live on)."""
    import distributed

    with (
        contextlib.suppress(Exception),
        distributed.Client(address, security=security, timeout=5, set_as_default=False) as c,
    ):
        c.shutdown()
    with contextlib.suppress(Exception):
        client = cluster.client
        client._send_recv(client._query_stream, "stop_distributed_request", {})


def workers_by_rank(client: distributed.Client) -> dict[int, str]:
    """Rank -> the address of its worker, as the scheduler of ``client`` knows them.

    Asked of the scheduler directly: ``client.scheduler_info()`` returns the client's cached
    identity, which its own 2-second refresh replaces with one listing no workers, so under
    load it can come back empty."""
    workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return {
        int(str(info["name"]).removeprefix("rank-")): address
        for address, info in workers.items()
        if str(info.get("name", "")).startswith("rank-")
    }
