"""axon_nb: train PyTorch models across many GPUs from a Jupyter notebook.

Example::

    %load_ext axon_nb
    %axon_cluster 4

or from Python::

    with axon_nb.Cluster(n=4) as cluster:
        cluster.run(fn)
"""

from __future__ import annotations

from typing import Any

from axon_nb import estimate
from axon_nb.checkpoint import Checkpoint
from axon_nb.cluster import Cluster, ClusterOptions, StackReport
from axon_nb.errors import (
    AxonError,
    ClusterBrokenError,
    ClusterStartError,
    NoClusterError,
    RankDiedError,
    RankError,
)
from axon_nb.estimate import advise
from axon_nb.strategies import (
    DDP,
    FSDP,
    Hybrid,
    LocalSGD,
    Pipeline,
    SingleDevice,
    Strategy,
    TensorParallel,
    ZeRO,
)
from axon_nb.train import TrainHandle, TrainResult, train_local

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "FSDP",
    "AxonError",
    "Checkpoint",
    "Cluster",
    "ClusterBrokenError",
    "ClusterOptions",
    "ClusterStartError",
    "ColumnParallelLinear",
    "Hybrid",
    "LocalSGD",
    "NoClusterError",
    "Pipeline",
    "RankDiedError",
    "RankError",
    "RowParallelLinear",
    "SingleDevice",
    "StackReport",
    "Strategy",
    "TensorParallel",
    "TrainHandle",
    "TrainResult",
    "ZeRO",
    "advise",
    "current_cluster",
    "estimate",
    "load_ipython_extension",
    "train_local",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:
    # Layers subclass torch.nn.Linear: imported on first use, so `import axon_nb` (the
    # kernel side) does not import torch.
    if name in ("ColumnParallelLinear", "RowParallelLinear"):
        from axon_nb.parallel import tensor

        return getattr(tensor, name)
    raise AttributeError(f"module 'axon_nb' has no attribute {name!r}")


def current_cluster() -> Cluster:
    """The cluster started by ``%axon_cluster`` in this kernel (see ``axon_nb.magics``).

    Example::

        %axon_cluster 2
        cluster = axon_nb.current_cluster()
    """
    from axon_nb.magics import current_cluster as current

    return current()


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%axon_cluster``, ``%%axon`` and ``%axon_run`` (``%load_ext axon_nb``)."""
    from axon_nb.magics import AxonMagics

    ipython.register_magics(AxonMagics(ipython))


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the extension's cluster, if one is running (``%unload_ext axon_nb``)."""
    from axon_nb.magics import AxonMagics

    magics = ipython.magics_manager.registry.get(AxonMagics.__name__)
    if magics is not None:
        magics.stop_cluster()
