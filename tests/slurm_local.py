"""A private Slurm for tests: munged, slurmctld and slurmd of this machine's Debian packages,
started with a configuration of their own (``SLURM_CONF``) and one node, this host.

Needs root and the ``slurm-wlm`` and ``munge`` packages (``make test`` installs them);
:func:`missing` says what is absent.

    with LocalSlurm() as slurm:   # os.environ["SLURM_CONF"] points at it meanwhile
        subprocess.run(["srun", "-n", "2", "hostname"])
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

import psutil
from started import Started

from axon_nb.rank.world.rendezvous_port import free_port

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
    """One partition, ``debug``, of one node (this host, 8 CPUs declared)."""

    def __init__(self) -> None:
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
        return (self.dir / "slurmd.pid").exists()

    def _start(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        (d / "spool").mkdir()
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
        Path(self.conf).write_text(
            f"ClusterName=axnb\nSlurmctldHost={node}\nAuthType=auth/munge\n"
            f"AuthInfo=socket={d / 'munge.sock'}\nCredType=cred/munge\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"SlurmctldPort={ctld_port}\nSlurmdPort={_free_port(besides=ctld_port)}\n"
            f"StateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d / 'spool'}\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={d / 'slurmctld.log'}\nSlurmdLogFile={d / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SchedulerType=sched/builtin\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\nSlurmdParameters=config_overrides\n"
            "ReturnToService=2\nMpiDefault=none\nJobAcctGatherType=jobacct_gather/none\n"
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n"
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE\n"
        )
        os.environ["SLURM_CONF"] = self.conf
        subprocess.run(["slurmctld", "-i"], check=True, capture_output=True, timeout=30)
        subprocess.run(["slurmd"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20
            ).stdout
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurmd did not come up: {(d / 'slurmd.log').read_text()}")
            time.sleep(0.3)

    def close(self) -> None:
        """Cancel every job, stop the daemons and remove the configuration."""
        if Path(self.conf).exists():
            subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True, timeout=20)
            deadline = time.monotonic() + 20  # let slurmd end the jobs' steps first
            while self._alive() and self.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
        for daemon in reversed(DAEMONS):
            pid_file = self.dir / f"{daemon}.pid"
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        time.sleep(1)
        for proc in psutil.process_iter(["name", "create_time"]):  # steps slurmd left behind
            if proc.info["name"] == "slurmstepd" and proc.info["create_time"] >= self._began:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        if self._saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._saved
        shutil.rmtree(self.dir, ignore_errors=True)
