"""``cluster.dask()``: a dask cluster whose workers are the ranks themselves.

The scheduler runs in the ipyparallel controller (what ``ipyparallel.Client.become_dask``
asks it for) and binds the controller's address: loopback on one host, the ranks' network
across hosts. Each rank's engine runs one worker (``axon_nb.rank.data.dask_worker``) on its own
address toward the scheduler, so dask work (reading files, filtering, featurizing) runs on
the ranks' cores and memory, and what a rank computes for training stays in its process.

Stopped with the cluster; after a restart (fresh ranks, fresh controller) the next call makes
a new one.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from axon_nb.errors import AxonError
from axon_nb.rank import entry

if TYPE_CHECKING:
    import distributed

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

    def ensure(self, cluster: ClusterLike) -> distributed.Client:
        """The client, started now if there is none or the ranks changed since."""
        if self.client is not None and self._serves(cluster):
            return self.client
        self.close()
        host = _scheduler_host(cluster)
        address = _start_scheduler(cluster, host)
        cluster.run(entry.start_dask_worker, address, stream=False)
        import distributed

        client = distributed.Client(address, timeout=START_TIMEOUT_S, set_as_default=True)
        try:
            client.wait_for_workers(len(cluster.ranks), timeout=START_TIMEOUT_S)
        except BaseException:
            client.close()
            raise
        self.client = client
        self.workers = _workers_by_rank(client)
        return client

    def close(self) -> None:
        """Close the client (the workers and scheduler end with the ranks and controller)."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=5)
        self.client = None
        self.workers = {}

    def _serves(self, cluster: ClusterLike) -> bool:
        if self.client is None or self.client.status != "running":
            return False
        with contextlib.suppress(Exception):
            return _workers_by_rank(self.client) == self.workers and len(self.workers) == len(
                cluster.ranks
            )
        return False


def _scheduler_host(cluster: ClusterLike) -> str:
    ipp_cluster = cluster._ipp
    if ipp_cluster is None:
        raise AxonError("the cluster is not running: start it before cluster.dask()")
    return ipp_cluster.controller_ip or "127.0.0.1"


def _start_scheduler(cluster: ClusterLike, host: str) -> str:
    """Ask the controller to run a dask scheduler on ``host``; its address.

    This is the request ``ipyparallel.Client.become_dask`` sends before it starts workers
    with one set of arguments for every engine; here each rank's worker binds its own address.
    """
    client = cluster.client
    reply = client._send_recv(
        client._query_stream,
        "become_dask_request",
        {
            "scheduler_args": {
                "host": host,
                "dashboard_address": f"{host}:0",
                "worker_ttl": WORKER_TTL_S,
            }
        },
    )
    if reply["content"]["status"] != "ok":
        raise AxonError(f"the controller could not start a dask scheduler: {reply['content']}")
    return str(reply["content"]["address"])


def _workers_by_rank(client: Any) -> dict[int, str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {
        int(str(info["name"]).removeprefix("rank-")): address
        for address, info in workers.items()
        if str(info.get("name", "")).startswith("rank-")
    }
