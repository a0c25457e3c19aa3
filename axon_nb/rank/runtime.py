"""The rank's view of the world, set once by the bootstrap and read by everything else on it.

Later layers (training loop, strategies) call :func:`context` instead of re-deriving ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_CONTEXT: RankContext | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankContext:
    """Where this engine sits in the torch.distributed world."""

    rank: int
    """Global rank (equals the ipyparallel engine id and, under MPI, the MPI rank)."""
    world_size: int
    """Number of ranks in the world."""
    local_rank: int
    """Rank among the engines on the same host."""
    local_world_size: int
    """Number of engines on this host."""
    host: str
    """Host name of this engine."""
    pid: int
    """Process id of this engine."""
    device: Any
    """``torch.device`` this rank computes on."""
    backend: str
    """torch.distributed backend of the default process group (``nccl`` or ``gloo``)."""
    master_addr: str
    """Address of the rendezvous store (rank 0's host)."""
    master_port: int
    """Port of the rendezvous store."""
    timeout_s: float
    """Timeout of collectives in seconds."""
    store_dir: str | None = None
    """When every rank is on one host: the owner-only directory whose file is the rendezvous
    store (a ``FileStore``, so no rank listens on a port for it); None: a ``TCPStore`` on
    ``master_addr:master_port``."""
    private_dir: str | None = None
    """The cluster's owner-only directory where it exists on this host (the kernel's): what
    the rank writes for the cluster (a dask worker's scratch) goes under it; None elsewhere,
    where such files go to a new owner-only directory of their own."""

    def summary(self) -> dict[str, Any]:
        """Plain-data description, safe to send to the kernel (no torch objects)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "host": self.host,
            "pid": self.pid,
            "device": str(self.device),
            "backend": self.backend,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "store": "file" if self.store_dir else f"tcp://{self.master_addr}:{self.master_port}",
        }


def set_context(ctx: RankContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def context() -> RankContext:
    """Return this rank's :class:`RankContext`.

    Example (in a ``%%axon`` cell)::

        from axon_nb.rank.runtime import context
        print(context().local_rank)
    """
    if _CONTEXT is None:
        raise RuntimeError(
            "this process is not an axon_nb rank: start a cluster with `%axon_cluster N` "
            "or `axon_nb.Cluster(n=N)` and run code on it"
        )
    return _CONTEXT
