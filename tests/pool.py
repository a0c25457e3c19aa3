"""The pool of started clusters that test modules share (``conftest.py``'s ``cluster_pool``)."""

from __future__ import annotations

import dataclasses

from helpers import fresh_world_sum

import axon_nb


class ClusterPool:
    """Started clusters kept for the whole session of one pytest worker, one per set of
    options: a module asks for ``get(n)`` and gets the running cluster of earlier modules when
    it is still healthy with the same options, else a fresh one. A cluster start is seconds of
    CPU for every rank (each imports torch), the largest cost of the suite on two cores.

    Example::

        pool = ClusterPool()
        cluster = pool.get(2)  # started; a later get(2) hands back the same one
        pool.close()
    """

    def __init__(self) -> None:
        self._clusters: dict[tuple[int, float], tuple[axon_nb.Cluster, object]] = {}

    def get(self, n: int, timeout: float = 120) -> axon_nb.Cluster:
        key = (n, timeout)
        if key in self._clusters:
            cluster, options = self._clusters.pop(key)
            if self._healthy(cluster, options):
                self._clusters[key] = (cluster, options)
                return cluster
            cluster.stop(keep_warm=True)  # (the next one's engines are forked at once)
        cluster = axon_nb.Cluster(n=n, timeout=timeout).start()
        self._clusters[key] = (cluster, dataclasses.replace(cluster.options))
        return cluster

    @staticmethod
    def _healthy(cluster: axon_nb.Cluster, options: object) -> bool:
        """Running with the options it was started with (a test may stop, resize or break
        it; one that restarted it or recovered a rank hands back a cluster as good as new),
        nothing left going on its ranks, and every rank in one world; the runs an earlier
        module left on the ranks are dropped."""
        n = cluster.options.n
        if not cluster.running or cluster.options != options:
            return False
        if len(cluster.ranks) != n or cluster._client.outstanding:  # a run left going
            return False
        try:
            return cluster.run(fresh_world_sum, stream=False) == [n] * n
        except Exception:
            return False

    def close(self) -> None:
        for cluster, _ in self._clusters.values():
            cluster.stop()
        self._clusters.clear()
