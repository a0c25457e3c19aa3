"""Checkpoints (kernel side): the on-disk format, and ``save`` / ``load`` over a cluster.

The ranks' side of writing and reading is ``axon_nb.rank.checkpoint.checkpoint_io``.
"""

from axon_nb.checkpoint.on_cluster import load, save
from axon_nb.spec.checkpoint_format import Checkpoint

__all__ = ["Checkpoint", "load", "save"]
