"""axon_nb: train PyTorch models across many GPUs from a Jupyter notebook.

Example::

    %load_ext axon_nb
    %axon_cluster 4

or from Python::

    with axon_nb.Cluster(n=4) as cluster:
        cluster.run(fn)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use (below)
    from axon_nb import estimate
    from axon_nb.checkpoint import Checkpoint
    from axon_nb.cluster import Cluster, ClusterOptions, StackReport
    from axon_nb.cluster.detached import clusters
    from axon_nb.cluster.detaching import stop_detached
    from axon_nb.errors import (
        AxonError,
        ClusterBrokenError,
        ClusterStartError,
        NoClusterError,
        RankDiedError,
        RankError,
    )
    from axon_nb.estimate import advise
    from axon_nb.job import job, jobs
    from axon_nb.job.submission import submit
    from axon_nb.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from axon_nb.spec.pretrained_model import pretrained
    from axon_nb.strategies import (
        DDP,
        FSDP,
        AsyncSGD,
        DiLoCo,
        ExpertParallel,
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
    "AsyncSGD",
    "AxonError",
    "Checkpoint",
    "Cluster",
    "ClusterBrokenError",
    "ClusterOptions",
    "ClusterStartError",
    "ColumnParallelLinear",
    "DiLoCo",
    "ExpertParallel",
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
    "attach",
    "clusters",
    "current_cluster",
    "estimate",
    "job",
    "jobs",
    "load_ipython_extension",
    "pretrained",
    "stop_detached",
    "submit",
    "train_local",
    "unload_ipython_extension",
]


_LAZY = {
    "estimate": "axon_nb.estimate",
    "Checkpoint": "axon_nb.checkpoint",
    "Cluster": "axon_nb.cluster",
    "ClusterOptions": "axon_nb.cluster",
    "StackReport": "axon_nb.cluster",
    "clusters": "axon_nb.cluster.detached",
    "stop_detached": "axon_nb.cluster.detaching",
    "submit": "axon_nb.job.submission",
    "job": "axon_nb.job",
    "jobs": "axon_nb.job",
    "AxonError": "axon_nb.errors",
    "ClusterBrokenError": "axon_nb.errors",
    "ClusterStartError": "axon_nb.errors",
    "NoClusterError": "axon_nb.errors",
    "RankDiedError": "axon_nb.errors",
    "RankError": "axon_nb.errors",
    "advise": "axon_nb.estimate",
    "ColumnParallelLinear": "axon_nb.parallel.tensor",
    "RowParallelLinear": "axon_nb.parallel.tensor",
    "pretrained": "axon_nb.spec.pretrained_model",
    **dict.fromkeys(
        [
            "AsyncSGD",
            "DDP",
            "DiLoCo",
            "ExpertParallel",
            "FSDP",
            "Hybrid",
            "LocalSGD",
            "Pipeline",
            "SingleDevice",
            "Strategy",
        ],
        "axon_nb.strategies",
    ),
    "TensorParallel": "axon_nb.strategies",
    "ZeRO": "axon_nb.strategies",
    "TrainHandle": "axon_nb.train",
    "TrainResult": "axon_nb.train",
    "train_local": "axon_nb.train",
}
"""Where each public name lives. ``import axon_nb`` loads none of them (PEP 562): a rank, the
launcher and the reaper import ``axon_nb.rank...`` or ``axon_nb.cluster.reaper`` without the
kernel side (ipyparallel, widgets) or torch coming along."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'axon_nb' has no attribute {name!r}")
    import importlib

    loaded = importlib.import_module(module)
    value = loaded if module.rsplit(".", 1)[-1] == name else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def current_cluster() -> Cluster:
    """The cluster started by ``%axon_cluster`` in this kernel (see ``axon_nb.magics``).

    Example::

        %axon_cluster 2
        cluster = axon_nb.current_cluster()
    """
    from axon_nb.magics import current_cluster as current

    return current()


def attach(name: str, *, replay: bool = True) -> Cluster:
    """The running detached cluster ``name`` of this user, from any kernel: the same ranks,
    the names earlier ``%%axon`` cells set and the models they hold, and its runs
    (``cluster.handle("model")``); with ``replay``, what each rank printed lately is printed
    first. In IPython with ``%load_ext axon_nb`` it becomes the kernel's cluster for the
    magics (as ``%axon_attach NAME`` does).

    Example::

        cluster = axon_nb.attach("lab")
        result = cluster.handle("model").wait()
    """
    from axon_nb.cluster.attach_api import attach as attach_cluster

    cluster = attach_cluster(name, replay=replay)
    if "IPython" in __import__("sys").modules:
        from axon_nb.magics import AxonMagics

        if AxonMagics.instance is not None:
            AxonMagics.instance.cluster = cluster
    return cluster


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
