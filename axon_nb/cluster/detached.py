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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axon_nb.cluster.options import NAME_PATTERN, check_name
from axon_nb.cluster.stopping import alive
from axon_nb.errors import AxonError
from axon_nb.spec.kept_runs import KeptRun, kept_runs


def clusters_dir() -> Path:
    """This user's directory of detached clusters (made 0700 if missing)."""
    from jupyter_core.paths import jupyter_runtime_dir

    base = Path(jupyter_runtime_dir())
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = base / "axon-clusters"
    path.mkdir(exist_ok=True, mode=0o700)
    return path


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
    """``name`` (or a new one) and its new directory; a name held by a running cluster of
    this user is refused (a stale one, whose keeper is gone, is taken over)."""
    if name is None:
        name = f"axon-{secrets.token_hex(3)}"
    check_name(name)
    root = clusters_dir() / name
    if root.exists():
        record = read_record(root)
        if record is not None and alive(record.get("keeper_pid", -1)):
            raise AxonError(
                f"a detached cluster named {name!r} is running: attach to it with "
                f"`%axon_attach {name}`, or choose another name"
            )
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o700)
    return name, root


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
    """Mark this kernel as attached to the cluster at ``root``."""
    leases = root / "attached"
    leases.mkdir(mode=0o700, exist_ok=True)
    (leases / str(os.getpid())).write_text(str(time.time()))


def release_lease(root: Path) -> None:
    (root / "attached" / str(os.getpid())).unlink(missing_ok=True)


def attached(root: Path) -> list[int]:
    """The pids of the kernels attached now (leases of dead ones are removed)."""
    leases = root / "attached"
    pids = []
    for lease in leases.iterdir() if leases.is_dir() else []:
        if lease.name.isdigit() and alive(int(lease.name)):
            pids.append(int(lease.name))
        else:
            lease.unlink(missing_ok=True)
    return sorted(pids)


def ranks_alive(record: dict[str, Any]) -> dict[int, bool]:
    return {int(r): alive(pid) for r, pid in record.get("pids", {}).items()}


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
        if record is None or not alive(record.get("keeper_pid", -1)):
            if record is not None or _older_than(root, 60):  # (one being made is left alone)
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
        if record is not None and alive(record.get("keeper_pid", -1)) and record["ranks"]:
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
