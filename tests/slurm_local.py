"""A private Slurm for tests: munged, slurmctld and slurmd of this machine's Debian packages,
started with a configuration of their own (``SLURM_CONF``): one node, this host, or one node
per namespaced host (``tests/netns_hosts.py``), each with its own slurmd.

Needs root and the ``slurm-wlm`` and ``munge`` packages (``make test`` installs them);
:func:`missing` says what is absent.

    with LocalSlurm() as slurm:   # os.environ["SLURM_CONF"] points at it meanwhile
        subprocess.run(["srun", "-n", "2", "hostname"])

    with NetnsHosts(2) as hosts, LocalSlurm(hosts) as slurm:   # nodes axnb1 and axnb2
        subprocess.run(["srun", "-N", "2", "hostname"])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from started import Started

from axon_nb.rank.world.rendezvous_port import free_port

if TYPE_CHECKING:
    from netns_hosts import NetnsHosts

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a private Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd)"
    for tool in (*DAEMONS, "sbatch", "squeue", "srun"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs `{tool}` (make test installs slurm-wlm and munge)"
    return None


def _free_port(*, besides: int = 0) -> int:
    """A free port below the kernel's ephemeral range (``rank/world/rendezvous_port.py``):
    Slurm's daemons bind the ports their configuration names, seconds after it is written,
    and a port picked by binding port 0 comes from the range every other worker's
    controllers, kernels and servers bind from (one of them took JupyterLab's that way)."""
    while (port := free_port()) == besides:
        pass
    return port


class LocalSlurm(Started):
    """One partition, ``debug``: this host (8 CPUs declared), or ``hosts`` (4 CPUs each;
    slurmctld stays on this host, at the bridge's address for them). Jobs are followed
    without accounting: ``squeue`` while they run, ``scontrol show job`` for a while after."""

    def __init__(self, hosts: NetnsHosts | None = None) -> None:
        self.hosts = hosts
        self.nodes = hosts.names if hosts is not None else [socket.gethostname().split(".")[0]]
        self.dir = Path(tempfile.mkdtemp(prefix="axnb-slurm-"))
        self.conf = str(self.dir / "slurm.conf")
        self._saved = os.environ.get("SLURM_CONF")
        self._began = time.time()

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm knows as pending or running."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20
        ).stdout
        return out.split()

    def _alive(self) -> bool:
        return any((self.dir / f"slurmd-{n}.pid").exists() for n in self.nodes)

    def _node_lines(self) -> str:
        if self.hosts is None:
            return f"NodeName={self.nodes[0]} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n"
        return "".join(
            f"NodeName={n} NodeAddr={a} CPUs=4 State=UNKNOWN\n"
            for n, a in zip(self.hosts.names, self.hosts.addresses, strict=True)
        )

    def _partition_lines(self) -> str:
        """``debug``; across hosts also ``urgent``, whose jobs preempt ``debug``'s (requeued:
        SIGTERM, then KillWait before SIGKILL), as on clusters with spot partitions."""
        nodes = ",".join(self.nodes)
        if self.hosts is None:
            return (f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE\n")  # fmt: skip
        return (
            "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\n"
            f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
            "PriorityTier=1 GraceTime=30\n"
            f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2 "
            "PreemptMode=OFF\n"
        )

    def _start_slurmds(self) -> None:
        """One slurmd per node; a namespaced host's runs inside it, under its host name."""
        if self.hosts is None:
            subprocess.run(["slurmd"], check=True, capture_output=True, timeout=30)
            return
        for name in self.hosts.names:
            # (not ``ip netns exec``: it mounts a sysfs of its own, without the cgroup tree
            # slurmd needs; the host's name service is bound in as ``ip netns exec`` does)
            etc = f"/etc/netns/{name}"
            started = subprocess.run(
                ["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c",
                 f"hostname {name} && mount --bind {etc}/hosts /etc/hosts && "
                 f"mount --bind {etc}/resolv.conf /etc/resolv.conf && exec slurmd"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if started.returncode != 0:
                logs = "".join(p.read_text() for p in self.dir.glob("slurmd-*.log"))
                raise RuntimeError(f"slurmd on {name} did not start: {started.stderr}{logs}")

    def _start(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        for node in self.nodes:
            (d / f"spool-{node}").mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            ["munged", f"--key-file={key}", f"--socket={d / 'munge.sock'}",
             f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
             f"--seed-file={d / 'munge.seed'}", "--force"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        node = socket.gethostname().split(".")[0]
        ctld_port = _free_port()
        # cred_expire: a requeued job waits that long before it may start again (120 s)
        Path(self.conf).write_text(
            f"ClusterName=axnb\nSlurmctldHost={node}\nAuthType=auth/munge\n"
            f"AuthInfo=socket={d / 'munge.sock'},cred_expire=10\nCredType=cred/munge\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"SlurmctldPort={ctld_port}\nSlurmdPort={_free_port(besides=ctld_port)}\n"
            f"StateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d / 'spool-%n'}\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={d / 'slurmctld.log'}\nSlurmdLogFile={d / 'slurmd-%n.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=2\n"
            "SelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\nSlurmdParameters=config_overrides\n"
            "ReturnToService=2\nMpiDefault=none\nJobAcctGatherType=jobacct_gather/none\n"
            f"{self._node_lines()}"
            f"{self._partition_lines()}"
        )
        os.environ["SLURM_CONF"] = self.conf
        subprocess.run(["slurmctld", "-i"], check=True, capture_output=True, timeout=30)
        self._start_slurmds()
        deadline = time.monotonic() + 30
        while subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20
        ).stdout.split().count("idle") < len(self.nodes):
            if time.monotonic() > deadline:
                logs = "".join(p.read_text() for p in d.glob("slurm*.log"))
                raise RuntimeError(f"slurmd did not come up: {logs}")
            time.sleep(0.3)

    def _owns(self, step: psutil.Process) -> bool:
        """Whether ``step`` (a ``slurmstepd``) is one of this Slurm's: it works in, logs to
        and listens in this Slurm's directory."""
        mine = str(self.dir) + os.sep
        paths = [step.cwd() + os.sep, *(f.path for f in step.open_files())]
        paths += [str(c.laddr) for c in step.net_connections(kind="unix")]
        return any(path.startswith(mine) for path in paths)

    def close(self) -> None:
        """Cancel every job, stop the daemons and remove the configuration."""
        if Path(self.conf).exists():
            subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True, timeout=20)
            deadline = time.monotonic() + 20  # let slurmd end the jobs' steps first
            while self._alive() and self.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
        pid_files = [self.dir / f"slurmd-{n}.pid" for n in self.nodes]
        for pid_file in [*pid_files, self.dir / "slurmctld.pid", self.dir / "munged.pid"]:
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        time.sleep(1)
        for proc in psutil.process_iter(["name", "create_time"]):  # steps slurmd left behind
            if proc.info["name"] == "slurmstepd" and proc.info["create_time"] >= self._began:
                with contextlib.suppress(psutil.Error):
                    if self._owns(proc):  # (another worker's Slurm may run jobs meanwhile)
                        proc.kill()
        if self._saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._saved
        shutil.rmtree(self.dir, ignore_errors=True)
