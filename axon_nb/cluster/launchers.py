"""Engine launchers by name: each configures an ``ipyparallel.Cluster`` for one way of starting."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import ipyparallel as ipp

from axon_nb.cluster import warm_engines
from axon_nb.cluster.dask_tls import cluster_tls, scheduler_environment
from axon_nb.cluster.options import ClusterOptions, format_hosts
from axon_nb.cluster.private_paths import private_cache_environment
from axon_nb.cluster.slurm_notice import write_srun_wrapper
from axon_nb.errors import ClusterStartError
from axon_nb.spec.bootstrap_spec import address_toward
from axon_nb.spec.notice_signal import ENV as NOTICE_ENV
from axon_nb.spec.warm_engines import SERVER_ENV

MPI_HINT = (
    "Install MPICH into this Python environment with `pip install mpich` (it provides "
    "`mpiexec`; mpi4py's wheels use it), or start engines without MPI: "
    "`%axon_cluster N --engines local`."
)


def engine_cmd() -> list[str]:
    """What ``mpiexec`` starts on each rank: the engine (``rank/world/engine.py``:
    ipyparallel's, with torch imported on a side thread) under its parent,
    ``rank/world/launch.py``; with this interpreter, as it is when the cluster starts."""
    return [
        sys.executable, "-m", "axon_nb.rank.world.launch",
        sys.executable, "-m", "axon_nb.rank.world.engine",
    ]  # fmt: skip


ENGINE_ARGS = ["--IPEngine.timeout=120"]
"""The engine waits this long for the controller to answer its registration. ipyparallel's 5 s
default is too short on a loaded machine: the engine gave up and exited before the controller
(busy starting) answered, and the start failed with "0 of N engines connected"."""

CONTROLLER_ARGS = [
    "--IPController.use_threads=True",
    "--HeartMonitor.period=250",
    "--HeartMonitor.max_heartmonitor_misses=120",
]
"""The controller's schedulers run as threads of one process instead of eight processes (the
messages a cluster sends are few and small), and it beats every 0.25 s instead of 3 s: an engine
is counted as connected only after a heartbeat, which cost up to 6 s of every start. An engine
is dropped after 30 s without answering a beat (it answers from a thread outside the GIL)."""


def controller_cmd() -> list[str]:
    """ipyparallel's controller with CurveZMQ, an HMAC key and an owner-only umask
    (``cluster/controller_process.py``), with this interpreter as it is when the cluster
    starts (not when this module was imported)."""
    return [sys.executable, "-m", "axon_nb.cluster.controller_process"]


def configure_controller(cluster: ipp.Cluster, private_dir: Path) -> None:
    """The controller's command (:func:`controller_cmd`) and environment: dask's settings for
    the scheduler ``cluster.dask()`` asks it for (TLS with the cluster's certificates in
    ``private_dir``, no HTTP routes, scratch in ``private_dir``).

    The IPython profile directory, where ipyparallel writes connection files and the
    controller's and engines' output (files it makes 0644, in a 0755 ``log/``), is made
    owner-only: with a home directory others can enter, they could read those."""
    profile = Path(cluster.profile_dir)
    profile.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(profile, 0o700)
    launcher = cluster.config.LocalControllerLauncher
    launcher.controller_cmd = controller_cmd()
    launcher.environment = scheduler_environment(cluster_tls(private_dir), private_dir)


def engine_environment(log_path: str, options: ClusterOptions) -> dict[str, str]:
    """What every engine launcher adds to the ranks' environment: where engines write, their
    preemption notice's signal, and torch's compile cache in the user's own cache directory
    (``cluster/private_paths.py``)."""
    return {"AXON_NB_ENGINE_LOG": log_path, NOTICE_ENV: options.preempt_signal,
            **private_cache_environment()}  # fmt: skip


def warm_engine_environment(options: ClusterOptions) -> dict[str, str]:
    """Where this host's ranks get their engines forked (``cluster/warm_engines.py``): one
    host only (a rank on another host starts its engine as a process), and not for a detached
    cluster (the warm process ends with its kernel)."""
    if options.detach:
        return {}
    directory = warm_engines.server_directory()
    return {SERVER_ENV: directory} if directory else {}


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


def _configure_mpi(cluster: ipp.Cluster, options: ClusterOptions, log_path: str) -> None:
    """One host: MPICH's ``gforker``, which starts the ranks as its own children and talks to
    them over socket pairs, so nothing listens beyond loopback (hydra's ``mpiexec`` listens on
    all interfaces for its proxies). Elsewhere (another MPI): its ``mpiexec``.

    Across hosts (``options.hosts``): hydra's ``mpiexec`` starts a proxy on each host over
    ssh (``-launcher ssh``; ``HYDRA_LAUNCHER_EXEC`` names another ssh), and MPI talks on
    ``options.iface``."""
    launcher = cluster.config.MPIEngineSetLauncher
    extra: list[str] = []
    if options.hosts is not None:
        mpiexec = find_mpiexec()
        kernel_addr = route_address(options.hosts[0][0])
        _bind_controller(cluster, kernel_addr)
        extra = ["-launcher", "ssh", "-hosts", format_hosts(options.hosts)]
        extra += ["-localhost", kernel_addr]  # where the proxies reach mpiexec
        environment = _network_mpi_env(options.iface)
    else:
        try:
            mpiexec = find_mpiexec("mpiexec.gforker")
        except ClusterStartError:
            mpiexec = find_mpiexec()
        environment = {**LOOPBACK_MPI_ENV, **warm_engine_environment(options)}
    launcher.mpi_cmd = [mpiexec]
    launcher.environment = {**environment, **engine_environment(log_path, options)}
    launcher.engine_args = list(ENGINE_ARGS)  # (ipyparallel adds --mpi)
    # A rank killed by a signal must not take the others with it (hydra's and gforker's
    # process managers end the rest): its parent, ``rank/world/launch.py``, keeps its MPI slot, and
    # the survivors keep their state (``cluster.rescue``).
    launcher.engine_cmd = engine_cmd()
    if _is_hydra(mpiexec):
        # Without this, hydra kills every rank when one exits early, and the kernel can no
        # longer tell which rank it was.
        launcher.mpi_args = ["-disable-auto-cleanup", *extra]


SLURM_JOB = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=axon-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --output={log_dir}/axon-slurm-%j.out
#SBATCH --signal={notice}@90
trap '' {notice}
exec {mpiexec} -disable-auto-cleanup -n {n} {program_and_args}
"""
"""The engines' batch job: hydra's ``mpiexec`` inside the allocation starts a proxy on each of
its nodes with ``srun``, and the ranks under them (``{program_and_args}``: the engine command,
which ipyparallel fills in). The preemption notice comes 90 s before the time limit; hydra's
processes ignore it (``cluster/slurm_notice.py``), the ranks' runs take it."""


def _configure_slurm(cluster: ipp.Cluster, options: ClusterOptions, log_path: str) -> None:
    """Ranks in a Slurm job. Inside an allocation (this kernel runs in one), hydra's
    ``mpiexec`` uses it directly; elsewhere ipyparallel's Slurm launcher submits
    :data:`SLURM_JOB` with ``sbatch`` (``--partition``, ``--time``) and ``scancel`` stops it."""
    mpiexec = find_mpiexec("mpiexec.hydra")
    environment = {**_network_mpi_env(options.iface), **engine_environment(log_path, options)}
    _bind_controller(cluster, _toward_slurm_nodes(options.partition))
    log_dir = os.path.join(cluster.profile_dir, "log")
    os.makedirs(log_dir, exist_ok=True)
    # hydra's proxies must outlive the preemption notice (cluster/slurm_notice.py)
    environment["HYDRA_LAUNCHER_EXEC"] = write_srun_wrapper(log_dir, options.preempt_signal)
    if os.environ.get("SLURM_JOB_ID"):
        cluster.engine_launcher_class = "mpi"
        launcher = cluster.config.MPIEngineSetLauncher
        # (under `trap ''`: in an srun step, Slurm's notice reaches mpiexec too)
        trapped = f"trap '' {options.preempt_signal}; " + 'exec "$0" "$@"'
        launcher.mpi_cmd = ["/bin/sh", "-c", trapped, mpiexec]
        launcher.mpi_args = ["-disable-auto-cleanup"]
        launcher.engine_cmd = engine_cmd()
        launcher.engine_args = list(ENGINE_ARGS)
        launcher.environment = environment
        return
    cluster.engine_launcher_class = "slurm"
    launcher = cluster.config.SlurmEngineSetLauncher
    # The batch file and the job's output go to the profile's log directory, not the cwd.
    launcher.batch_file_name = os.path.join(log_dir, f"axon-slurm-{cluster.cluster_id}.sbatch")
    launcher.batch_template = (
        SLURM_JOB.replace("{mpiexec}", mpiexec)
        .replace("{log_dir}", log_dir)
        .replace("{notice}", options.preempt_signal)
    )
    launcher.engine_cmd = engine_cmd()
    launcher.engine_args = ["--mpi", *ENGINE_ARGS]
    launcher.environment = environment
    if options.partition:
        launcher.queue = options.partition
    if options.time:
        launcher.timelimit = options.time


def _network_mpi_env(iface: str | None) -> dict[str, str]:
    """MPICH's network module across hosts: on ``iface`` (hydra's ``-iface`` would apply to
    the kernel's host too), else on the interface libfabric picks."""
    environment = {k: v for k, v in LOOPBACK_MPI_ENV.items() if k != "FI_TCP_IFACE"}
    if iface is not None:
        environment["FI_TCP_IFACE"] = iface
    return environment


def _bind_controller(cluster: ipp.Cluster, address: str) -> None:
    """The controller listens on ``address`` (the ranks' network) only, and tells the engines
    to connect there."""
    cluster.controller_ip = address
    cluster.controller_location = address


def primary_address() -> str:
    """This host's address by its name (what other nodes of a batch system reach it on)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise ClusterStartError(f"this host's name does not resolve to an address: {e}") from None


def _toward_slurm_nodes(partition: str | None) -> str:
    """Where the batch job's nodes reach this host: its address by name, unless that is a
    loopback one (a name in ``/etc/hosts`` as ``127.0.0.1``), then the one on the network that
    reaches the partition's first node (``sinfo``'s NodeAddr)."""
    address = primary_address()
    if not address.startswith("127."):
        return address
    command = ["sinfo", "-h", "-N", "-o", "%o", *(["-p", partition] if partition else [])]
    try:
        nodes = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return address
    return route_address(nodes.split()[0]) if nodes.split() else address


def route_address(host: str) -> str:
    """This machine's address on the network that reaches ``host``."""
    try:
        return address_toward(host)
    except OSError as e:
        raise ClusterStartError(f"cannot reach host {host!r} from here: {e}") from None


def _configure_local(cluster: ipp.Cluster, options: ClusterOptions, log_path: str) -> None:
    cluster.engine_launcher_class = "local"
    launcher = cluster.config.LocalEngineSetLauncher
    launcher.engine_cmd = engine_cmd()
    launcher.engine_args = ENGINE_ARGS
    launcher.environment = {
        **engine_environment(log_path, options),
        **warm_engine_environment(options),
    }


LAUNCHERS: dict[str, Callable[[ipp.Cluster, ClusterOptions, str], None]] = {
    "mpi": _configure_mpi,
    "local": _configure_local,
    "slurm": _configure_slurm,
}
