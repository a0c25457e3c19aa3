"""Engine launchers by name: each configures an ``ipyparallel.Cluster`` for one way of starting."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import ipyparallel as ipp

from axon_nb.errors import ClusterStartError

MPI_HINT = (
    "Install MPICH into this Python environment with `pip install mpich` (it provides "
    "`mpiexec`; mpi4py's wheels use it), or start engines without MPI: "
    "`%axon_cluster N --engines local`."
)


ENGINE_PARENT = [sys.executable, "-m", "axon_nb.rank.launch"]
"""What ``mpiexec`` starts on each rank, with the engine's command as its arguments."""


def find_mpiexec() -> str:
    """The ``mpiexec`` of this environment if it has one, else the first on ``PATH``."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpiexec")
    if found is None:
        raise ClusterStartError(
            f"no `mpiexec` found (looked next to {sys.executable} and on PATH). {MPI_HINT}"
        )
    return found


@cache
def _is_hydra(mpiexec: str) -> bool:
    try:
        text = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in text


def _configure_mpi(cluster: ipp.Cluster) -> None:
    mpiexec = find_mpiexec()
    cluster.engine_launcher_class = "mpi"
    cluster.config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
    if _is_hydra(mpiexec):
        # Without this, MPICH kills every rank when one dies, and the kernel can no longer
        # tell which rank it was. The survivors keep their state (``cluster.rescue``) until
        # the engine set is stopped on restart. Each engine runs under ``rank/launch.py``,
        # since hydra's proxy kills its other children when one is killed by a signal.
        cluster.config.MPIEngineSetLauncher.mpi_args = ["-disable-auto-cleanup"]
        cluster.config.MPIEngineSetLauncher.engine_cmd = [
            *ENGINE_PARENT,
            sys.executable,
            "-m",
            "ipyparallel.engine",
        ]


def _configure_local(cluster: ipp.Cluster) -> None:
    cluster.engine_launcher_class = "local"


LAUNCHERS: dict[str, Callable[[ipp.Cluster], None]] = {
    "mpi": _configure_mpi,
    "local": _configure_local,
}
