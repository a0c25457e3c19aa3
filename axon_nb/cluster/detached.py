"""Detached clusters: their records, names, the kernels attached to them, and the listing.

A cluster started with ``detach=True`` outlives its kernel. Everything a later kernel needs
to attach is in the cluster's own directory, ``<jupyter runtime dir>/axon-clusters/<name>``
(0700 under the user's 0700 runtime directory, so no other user sees or reads it)::

    cluster.json     the record: options, ranks, processes, version and code hash
    attached/<pid>   one file per attached kernel (a dead kernel's is dropped)
    runs/, output/   what the ranks keep (``spec/kept_runs.py``)
    keeper.log       what the keeper (``cluster/keeper.py``) says

Example::

    for c in clusters():
        print(c.name, c.state, [r.describe() for r in c.runs])
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from axon_nb.cluster.options import NAME_PATTERN, check_name
from axon_nb.cluster.stopping import alive
from axon_nb.errors import AxonError
from axon_nb.spec.kept_runs import KeptRun, kept_runs

STARTING_S = 60.0
"""A cluster's directory without a record this long after it was made is stale (the keeper's
first record is written within a second of the claim)."""


def clusters_dir() -> Path:
    """This user's directory of detached clusters (made 0700 if missing); refused unless it
    and the runtime directory above it are this user's and closed to others (anyone who
    could write there could plant a record, and with it a controller to connect to or a
    pickle to load)."""
    return private_runtime_dir("axon-clusters")


def private_runtime_dir(name: str) -> Path:
    """``<Jupyter runtime dir>/<name>``, made 0700 if missing, checked as
    :func:`clusters_dir` says."""
    from jupyter_core.paths import jupyter_runtime_dir

    base = Path(jupyter_runtime_dir())
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = base / name
    path.mkdir(exist_ok=True, mode=0o700)
    for directory in (base, path):
        info = directory.lstat()
        if info.st_uid != os.getuid() or stat.S_ISLNK(info.st_mode) or info.st_mode & 0o022:
            raise AxonError(
                f"{directory} must be a directory of yours (uid {os.getuid()}) that no one "
                "else can write to: fix its owner and mode (chmod 700), or set "
                "JUPYTER_RUNTIME_DIR to one that is"
            )
    path.chmod(0o700)
    return path


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (None: there is none), to tell it from a later process
    that was given the same pid."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def same_process(pid: int, started: float | None) -> bool:
    """Process ``pid`` runs and is the one that started at ``started`` (a zombie has ended)."""
    if pid <= 0 or not alive(pid):
        return False
    now = process_start(pid)
    return started is None or (now is not None and abs(now - started) < 1.0)


def keeper_alive(record: dict[str, Any]) -> bool:
    """The record's keeper still runs (not another process that got its pid)."""
    return same_process(int(record.get("keeper_pid", -1)), record.get("keeper_started"))


@functools.cache
def code_hash() -> str:
    """A hash of the installed ``axon_nb`` code (every ``.py`` file's path and bytes): ranks
    started by other code could not be driven by this code."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def version() -> str:
    """The installed axon_nb's version (its distribution's metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("axon_nb")
    except PackageNotFoundError:  # (run from a checkout, not installed)
        return "unknown"


def claim_name(name: str | None) -> tuple[str, Path]:
    """``name`` (or a new one) and its new directory, made here (an exclusive ``mkdir``); a
    name held by a running or starting cluster of this user is refused (a stale one, whose
    keeper is gone, is taken over)."""
    if name is None:
        name = f"axon-{secrets.token_hex(3)}"
    check_name(name)
    root = clusters_dir() / name
    for _ in range(2):
        try:
            root.mkdir(mode=0o700)
            return name, root
        except FileExistsError:
            record = read_record(root)
            if (record is not None and keeper_alive(record)) or (
                record is None and not _older_than(root, STARTING_S)
            ):
                raise AxonError(
                    f"a detached cluster named {name!r} is running or starting: attach to it "
                    f"with `%axon_attach {name}`, or choose another name"
                ) from None
            shutil.rmtree(root, ignore_errors=True)  # (its keeper is gone: stale)
    raise AxonError(f"could not claim the name {name!r}: another start took it just now")


def write_record(root: Path, record: dict[str, Any]) -> None:
    part = root / "cluster.json.part"
    part.write_text(json.dumps(record, indent=1))
    os.replace(part, root / "cluster.json")


def read_record(root: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((root / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    return record


def hold_lease(root: Path) -> None:
    """Mark this kernel as attached to the cluster at ``root`` (the lease names this
    process's start time: a later process given its pid holds no lease)."""
    leases = root / "attached"
    leases.mkdir(mode=0o700, exist_ok=True)
    (leases / str(os.getpid())).write_text(repr(process_start(os.getpid())))


def release_lease(root: Path) -> None:
    (root / "attached" / str(os.getpid())).unlink(missing_ok=True)


def attached(root: Path) -> list[int]:
    """The pids of the kernels attached now (leases of dead ones are removed)."""
    leases = root / "attached"
    pids = []
    for lease in leases.iterdir() if leases.is_dir() else []:
        try:
            started = float(lease.read_text())
        except (OSError, ValueError):
            started = None
        if lease.name.isdigit() and same_process(int(lease.name), started):
            pids.append(int(lease.name))
        else:
            lease.unlink(missing_ok=True)
    return sorted(pids)


def ranks_alive(record: dict[str, Any]) -> dict[int, bool]:
    """Whether each rank's process still runs (the one the record names)."""
    times = record.get("pid_started", {})
    return {int(r): same_process(pid, times.get(r)) for r, pid in record.get("pids", {}).items()}


@dataclass(frozen=True)
class DetachedCluster:
    """One detached cluster of this user on this host, as :func:`clusters` lists it."""

    name: str
    ranks: int
    hosts: list[str]
    state: str
    """``running`` (its keeper runs), ``starting`` (no ranks yet) or ``ended``."""
    runs: list[KeptRun] = field(default_factory=list)
    attached: list[int] = field(default_factory=list)
    """Pids of the kernels attached to it."""
    started_at: float = 0.0

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started_at))
        runs = ", ".join(r.describe() for r in self.runs) or "no runs"
        who = (
            f"attached: kernel {', '.join(map(str, self.attached))}"
            if self.attached
            else "detached"
        )
        return (
            f"{self.name}: {self.ranks} ranks on {', '.join(self.hosts)}, {self.state}, {who}, "
            f"started {started}; {runs}"
        )


def clusters() -> list[DetachedCluster]:
    """This user's detached clusters on this host (the records of ended ones are removed).

    Example::

        axon_nb.clusters()   # [DetachedCluster(name='lab', ranks=8, state='running', ...)]
    """
    found = []
    for root in sorted(clusters_dir().iterdir()):
        record = read_record(root)
        if record is None or not keeper_alive(record):
            if record is not None or _older_than(root, STARTING_S):  # (one being claimed)
                shutil.rmtree(root, ignore_errors=True)
            continue
        found.append(
            DetachedCluster(
                name=record["name"],
                ranks=record["options"]["n"],
                hosts=sorted({r.get("host", socket.gethostname()) for r in record["ranks"]}),
                state="running" if record["ranks"] else "starting",
                runs=kept_runs(root, ranks_alive(record)),
                attached=attached(root),
                started_at=record["started_at"],
            )
        )
    return found


def find(name: str) -> Path:
    """The directory of this user's running detached cluster ``name``; an unknown name is
    refused with the names there are."""
    if NAME_PATTERN.fullmatch(name):
        root = clusters_dir() / name
        record = read_record(root)
        if record is not None and keeper_alive(record) and record["ranks"]:
            return root
    names = [c.name for c in clusters()]
    there = f"yours: {', '.join(names)}" if names else "you have none running"
    raise AxonError(
        f"no detached cluster named {name!r} on this host ({there}). `%axon_cluster --list` "
        "shows them; start one with `%axon_cluster N --detach --name NAME`"
    )


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False
