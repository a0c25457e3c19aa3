"""A detached cluster's entry in JupyterLab's Axon sidebar, written by its keeper.

A detached cluster may have no kernel, so its keeper (``cluster/keeper.py``) publishes it in
the same registry kernels use (``cluster/lab_registry.py``; read by ``axon_nb.server``), with
the keeper's pid (the server drops the entry once the keeper is gone): its ranks, its latest
run as the ranks kept it, who is attached, and the ``%axon_attach NAME`` line to copy. The
keeper carries out the sidebar's ``stop_cluster`` (it ends the cluster) and ``stop_run`` /
``interrupt`` (SIGINT to every rank, as Ctrl-C does).

Example (the keeper, once a second)::

    publish(record, runs, kernels)
    action = take_control(record)   # "stop_cluster", "stop_run", "interrupt" or None
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from axon_nb.cluster.lab_registry import registry_dir
from axon_nb.spec.kept_runs import KeptRun
from axon_nb.spec.lab_protocol import ACTIONS


def key_of(name: str) -> str:
    """The registry key of detached cluster ``name`` (a key has letters, digits, _ and -;
    one name, one key: ``_`` is written ``__`` and ``.`` ``_d``)."""
    return "detached-" + name.replace("_", "__").replace(".", "_d")


def publish(record: dict[str, Any], runs: list[KeptRun], kernels: list[int]) -> None:
    """Rewrite the cluster's entry (atomically, owner-only): ``runs`` as the ranks kept
    them, ``kernels`` attached (what the keeper read for this look)."""
    directory = registry_dir()
    key = key_of(record["name"])
    ranks = record["ranks"]
    state = {
        "key": key,
        "kernel_id": "",
        "cluster_id": record["name"],
        "pid": os.getpid(),
        "updated": time.time(),
        "notebook": None,
        "ranks": len(ranks),
        "hosts": sorted({str(r.get("host")) for r in ranks}),
        "devices": [str(r.get("device")) for r in ranks],
        "backend": str(ranks[0].get("backend")) if ranks else None,
        "status": "running",
        "memory": [],
        "run": _run_state(runs[-1]) if runs else None,
        "detached": {
            "name": record["name"],
            "attach": f"%axon_attach {record['name']}",
            "attached": kernels,
        },
    }
    partial = directory / f"cluster-{key}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(partial, directory / f"cluster-{key}.json")


def take_control(record: dict[str, Any]) -> str | None:
    """The sidebar's latest control for this cluster, its file removed (None: none)."""
    directory = registry_dir()
    action = None
    for control in sorted(directory.glob(f"control-{key_of(record['name'])}-*.json")):
        with contextlib.suppress(OSError, ValueError):
            wanted = json.loads(control.read_text()).get("action")
            action = wanted if wanted in ACTIONS else action
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
    return action


def remove(name: str) -> None:
    """Drop the cluster's entry (it ended)."""
    with contextlib.suppress(OSError):
        (registry_dir() / f"cluster-{key_of(name)}.json").unlink()


def _run_state(run: KeptRun) -> dict[str, Any]:
    state = "running" if run.running else "finished" if run.finished else "stopped"
    return {
        "name": run.name, "strategy": run.strategy, "state": state, "step": run.step,
        "steps": run.steps, "eta_s": None, "samples_per_s": 0, "losses": [],
        "failed_ranks": [], "stalled_ranks": [], "dashboard": None,
    }  # fmt: skip
