"""The kernel side of training: the run's spec, its handle while it runs, and its result."""

from axon_nb.train.handle import TrainHandle
from axon_nb.train.local import train_local
from axon_nb.train.result import TrainResult
from axon_nb.train.spec import TrainSpec

__all__ = ["TrainHandle", "TrainResult", "TrainSpec", "train_local"]
