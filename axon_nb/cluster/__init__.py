"""Kernel-side cluster lifecycle: start, run, signal, restart, stop. Never imports torch."""

from axon_nb.cluster.cluster import Cluster
from axon_nb.cluster.options import ClusterOptions
from axon_nb.cluster.stacks import StackReport

__all__ = ["Cluster", "ClusterOptions", "StackReport"]
