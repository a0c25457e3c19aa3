"""The features a ``Cluster`` delegates to, each a function over a cluster in its own module.

They type the cluster as ``transport.ClusterLike`` and never import ``Cluster``, so ``Cluster``
can import them here without an import circle.
"""

from axon_nb.checkpoint.on_cluster import load, rescue, save
from axon_nb.cluster.bandwidth import bandwidth
from axon_nb.cluster.resize import resize
from axon_nb.train.compare import compare
from axon_nb.train.evaluate import evaluate
from axon_nb.train.generate import generate
from axon_nb.train.on_cluster import train
from axon_nb.train.predict import predict

__all__ = [
    "bandwidth", "compare", "evaluate", "generate", "load", "predict", "rescue", "resize", "save",
    "train",
]  # fmt: skip
