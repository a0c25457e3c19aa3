"""The small protocol between kernels and the Jupyter server extension: where each kernel's
cluster state files live and which controls the server may write there
(``cluster/lab_registry.py`` writes and obeys; ``server/registry.py`` reads and asks)."""

from __future__ import annotations

from pathlib import Path

ACTIONS = ("stop_run", "interrupt", "restart", "stop_cluster")
"""Controls the sidebar may ask of a kernel's cluster."""


def registry_path() -> Path:
    """``<Jupyter runtime dir>/axon_nb`` (it may not exist yet)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "axon_nb"
