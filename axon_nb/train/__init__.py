"""The kernel side of training: the run's spec, ``train`` on a cluster, ``train_local`` in
this process, the handle of a run in progress and its result."""

from axon_nb.spec.train_spec import TrainSpec
from axon_nb.train.handle import TrainHandle
from axon_nb.train.local import train_local
from axon_nb.train.on_cluster import train
from axon_nb.train.result import TrainResult

__all__ = ["TrainHandle", "TrainResult", "TrainSpec", "train", "train_local"]
