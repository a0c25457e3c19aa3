"""What JupyterLab's Axon sidebar shows of this kernel's cluster, and the controls it sends back.

Each running cluster started in a Jupyter kernel keeps one state file in an owner-only
directory under Jupyter's runtime directory (``<runtime>/axon_nb``, mode 0700), rewritten
about once a second (atomically, mode 0600): its ranks, hosts, devices, backend, status,
memory per rank, and its current or last training run (progress, ETA, samples/s, the loss,
its layout changes, failed or stalled ranks, and the dashboard's whole state). The server
extension (``axon_nb.server``) lists these files; it drops an entry whose kernel process is
gone, and the file is removed when the cluster stops.

Controls come the other way: the server writes ``control-<key>-<id>.json`` files, which the
same thread reads, deletes and carries out: ``stop_run`` (every rank stops at the same step
boundary), ``interrupt``, ``restart`` and ``stop_cluster``.

Nothing listens on a port: the files are the only channel, readable by this user alone.

Example (what ``Cluster.start`` does in a kernel)::

    registry = LabRegistry(cluster, key="0c1f...-a1b2c3d4")
    registry.start()
    ...
    registry.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axon_nb.spec.lab_protocol import ACTIONS, registry_path

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

INTERVAL_S = 1.0
"""How often the state file is rewritten and controls are looked for."""
LOSS_POINTS = 100
"""Loss points of the run in the state file (the sidebar's sparkline), its whole curve thinned
evenly, the first and newest kept: a layout change is marked at the start."""


def registry_dir() -> Path:
    """:func:`registry_path`, created owner-only (0700) when missing (the kernel's side)."""
    path = registry_path()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def kernel_id() -> str | None:
    """This Jupyter kernel's id (from its connection file), or None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).stem
    except Exception:  # not in a kernel (a script, a test): no sidebar entry by default
        return None
    return re.sub(r"[^A-Za-z0-9_-]", "", name.removeprefix("kernel-")) or None


def prune(directory: Path) -> None:
    """Remove the entries (and pending controls) of kernels that died without stopping their
    clusters; the server already hides them, this keeps the directory from growing."""
    import psutil

    for path in directory.glob("cluster-*.json"):
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not psutil.pid_exists(pid):
            key = path.stem.removeprefix("cluster-")
            for stale in [path, *directory.glob(f"control-{key}-*.json")]:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()


class LabRegistry:
    """Publishes one cluster's state and carries out the controls sent to it."""

    def __init__(self, cluster: ClusterLike, key: str, directory: Path | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
            raise ValueError(f"a registry key has only letters, digits, _ and -; got {key!r}")
        self.cluster = cluster
        self.key = key
        self.directory = directory or registry_dir()
        self.path = self.directory / f"cluster-{key}.json"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="axon-lab-registry", daemon=True)

    @classmethod
    def for_kernel(cls, cluster: ClusterLike) -> LabRegistry | None:
        """A registry for ``cluster`` when this process is a Jupyter kernel (or when
        ``AXON_NB_KERNEL_ID`` names one, for tools that start clusters outside a kernel)."""
        kernel = os.environ.get("AXON_NB_KERNEL_ID") or kernel_id()
        if not kernel:
            return None
        return cls(cluster, f"{kernel}-{uuid.uuid4().hex[:8]}")

    def start(self) -> None:
        prune(self.directory)
        self.write()
        self._thread.start()

    def close(self) -> None:
        """Stop publishing and remove the state file (the sidebar drops the cluster)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        for control in self.directory.glob(f"control-{self.key}-*.json"):
            with contextlib.suppress(FileNotFoundError):
                control.unlink()

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            with contextlib.suppress(Exception):  # a failed write is retried next second
                self._carry_out_controls()
            if self._stop.is_set():
                return
            with contextlib.suppress(Exception):
                self.write()

    def write(self) -> None:
        """Rewrite the state file atomically, readable by this user only."""
        partial = self.path.with_suffix(".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.state(), f)
        os.replace(partial, self.path)

    def _carry_out_controls(self) -> None:
        for control in sorted(self.directory.glob(f"control-{self.key}-*.json")):
            try:
                action = json.loads(control.read_text()).get("action")
            except (OSError, ValueError):
                action = None
            with contextlib.suppress(FileNotFoundError):
                control.unlink()
            if action in ACTIONS:
                self.carry_out(action)

    def carry_out(self, action: str) -> None:
        """Do what the sidebar asked (each control was confirmed there where it loses work)."""
        cluster = self.cluster
        run = cluster.last_run
        if action == "stop_run":
            if run is not None and not run.done:  # (every rank stops at one step boundary)
                threading.Thread(target=run.request_stop, daemon=True).start()
        elif action == "interrupt":
            cluster.interrupt()
        elif action == "restart":
            cluster.restart()
        elif action == "stop_cluster":
            cluster.stop()

    # -- what is published ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        cluster = self.cluster
        ranks = list(cluster.ranks)
        run = cluster.last_run
        dashboard = run.dashboard.state if run is not None else None
        memory = dashboard.memory() if dashboard is not None else []
        return {
            "key": self.key,
            "kernel_id": self.key.rsplit("-", 1)[0],
            "cluster_id": self.key.rsplit("-", 1)[1],
            "pid": os.getpid(),
            "updated": time.time(),
            "notebook": os.environ.get("JPY_SESSION_NAME"),
            "ranks": len(ranks) or cluster.options.n,
            "hosts": sorted({str(r.get("host")) for r in ranks}),
            "devices": [str(r.get("device")) for r in ranks],
            "backend": str(ranks[0].get("backend")) if ranks else None,
            "status": "broken" if cluster.broken else "running" if cluster.running else "stopped",
            "memory": [
                {"rank": m["rank"], "used": m["held"], "total": max(m["held"], m["peak"])}
                for m in memory
            ],
            "run": _run_state(run) if run is not None else None,
        }


def _run_state(run: Any) -> dict[str, Any]:
    state = run.dashboard.state
    progress = state.progress()
    statuses = [state.status(r) for r in range(state.world_size)]
    if not run.done:
        phase = "running"
    elif "failed" in statuses:
        phase = "failed"
    elif progress["step"] < progress["total"]:
        phase = "stopped"
    else:
        phase = "finished"
    snapshot = state.snapshot()
    # named as the dashboard widget's traits, so the sidebar's tab drives the same view
    snapshot.update(title=run.dashboard.title, hang_report=run.dashboard.hang_report,
                    communication=snapshot.pop("comm"))  # fmt: skip
    return {
        "name": run.name,
        "strategy": run._spec.strategy.describe(),
        "state": phase,
        "step": progress["step"],
        "steps": progress["total"],
        "eta_s": progress["eta_s"],
        "samples_per_s": progress["samples_per_s"],
        "losses": _sparkline(state.steps, state.loss),
        "layout_changes": snapshot["layout_changes"],  # marked on the sparkline and named
        "failed_ranks": [r for r, s in enumerate(statuses) if s == "failed"],
        "stalled_ranks": [r for r, s in enumerate(statuses) if s == "stalled"],
        "dashboard": snapshot,
    }


def _sparkline(steps: list[int], losses: list[float]) -> list[list[float]]:
    """At most ``LOSS_POINTS + 1`` of the ``[step, loss]`` points: every k-th, and the newest."""
    points = [[s, v] for s, v in zip(steps, losses, strict=True)]
    stride = max(1, -(-len(points) // LOSS_POINTS))
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
