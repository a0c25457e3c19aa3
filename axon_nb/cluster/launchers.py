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


def find_mpiexec(kind: str = "mpiexec") -> str:
    """The ``kind`` launcher (``mpiexec``, ``mpiexec.gforker``) of this environment if it has
    one, else the first on ``PATH``."""
    beside_python = Path(sys.executable).parent / kind
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(kind)
    if found is None:
        raise ClusterStartError(
            f"no `{kind}` found (looked next to {sys.executable} and on PATH). {MPI_HINT}"
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


LOOPBACK_MPI_ENV = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",  # libfabric's tcp provider, bound to loopback
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
}
"""MPICH's network module on one host: it listens on loopback only (ranks on one host talk
through shared memory anyway)."""


def _configure_mpi(cluster: ipp.Cluster) -> None:
    """One host: MPICH's ``gforker``, which starts the ranks as its own children and talks to
    them over socket pairs, so nothing listens beyond loopback (hydra's ``mpiexec`` listens on
    all interfaces for its proxies). Elsewhere (another MPI): its ``mpiexec``."""
    launcher = cluster.config.MPIEngineSetLauncher
    try:
        mpiexec = find_mpiexec("mpiexec.gforker")
    except ClusterStartError:
        mpiexec = find_mpiexec()
    launcher.mpi_cmd = [mpiexec]
    launcher.environment = dict(LOOPBACK_MPI_ENV)
    # A rank killed by a signal must not take the others with it (hydra's and gforker's
    # process managers kill the rest): each engine runs under ``rank/launch.py``, which turns
    # that into an exit status. The survivors keep their state (``cluster.rescue``).
    launcher.engine_cmd = [*ENGINE_PARENT, sys.executable, "-m", "ipyparallel.engine"]
    if _is_hydra(mpiexec):
        # Without this, hydra kills every rank when one exits early, and the kernel can no
        # longer tell which rank it was.
        launcher.mpi_args = ["-disable-auto-cleanup"]


def _configure_local(cluster: ipp.Cluster) -> None:
    cluster.engine_launcher_class = "local"


LAUNCHERS: dict[str, Callable[[ipp.Cluster], None]] = {
    "mpi": _configure_mpi,
    "local": _configure_local,
}
