"""Kernel-side cluster lifecycle: start, run, signal, restart, stop. Never imports torch.

``Cluster``, ``ClusterOptions`` and ``StackReport`` load on first use, so the reaper and the
stop helpers (``reaper.py``, ``stopping.py``) start without ipyparallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axon_nb.cluster.cluster import Cluster
    from axon_nb.cluster.options import ClusterOptions
    from axon_nb.cluster.stacks import StackReport

__all__ = ["Cluster", "ClusterOptions", "StackReport"]

_WHERE = {
    "Cluster": "axon_nb.cluster.cluster",
    "ClusterOptions": "axon_nb.cluster.options",
    "StackReport": "axon_nb.cluster.stacks",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'axon_nb.cluster' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
