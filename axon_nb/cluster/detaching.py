"""A detached cluster as the kernel that started it, or attached to it, holds it.

``Cluster(detach=True)`` claims a name (``cluster/detached.py``), starts the keeper
(``cluster/keeper.py``) before the reaper, which then watches the keeper instead of the
kernel, and, once the world is joined, has every rank keep its output and runs in the
cluster's directory and writes the record that ``attach`` reads. Example::

    detached = Detached.claim("lab")
    keeper = detached.start_keeper(cluster_file, watch_dir, roots, idle_timeout=7200)
    ...
    detached.finish_start(cluster, roots)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from axon_nb.cluster import detached as records
from axon_nb.cluster.relay import relay_of
from axon_nb.cluster.stopping import alive
from axon_nb.errors import AxonError
from axon_nb.rank import entry
from axon_nb.spec.kept_runs import KeptRun, kept_runs, run_dir, write_atomically

if TYPE_CHECKING:
    import ipyparallel as ipp

    from axon_nb.cluster.options import ClusterOptions


class Started(Protocol):
    """What :meth:`Detached.finish_start` uses of the cluster that started."""

    options: ClusterOptions
    ranks: list[dict[str, Any]]

    @property
    def client(self) -> ipp.Client: ...

    def run(self, fn: Any, *args: Any, stream: bool = True, **kwargs: Any) -> list[Any]: ...


KEEPER_END_S = 5.0
"""How long a stop waits for the keeper to exit after SIGTERM."""


class Detached:
    """The directory and keeper of one detached cluster, from a kernel's side."""

    def __init__(
        self,
        name: str,
        root: Path,
        keeper_pid: int | None = None,
        keeper_started: float | None = None,
    ) -> None:
        self.name = name
        self.root = root
        self.keeper_pid = keeper_pid
        self.keeper_started = keeper_started
        """When the keeper process started (to tell it from a later process with its pid)."""

    @classmethod
    def claim(cls, name: str | None) -> Detached:
        """A new cluster's name (given or made up) and its directory."""
        return cls(*records.claim_name(name))

    def start_keeper(
        self, n: int, cluster_file: str, watch_dir: str, roots: list[int], idle_timeout: float
    ) -> int:
        """Start the keeper in its own session (so the kernel's signals and its process
        group's end miss it) and write the first record (``n`` ranks, starting); its pid."""
        with open(self.root / "keeper.log", "ab") as log:
            keeper = subprocess.Popen(
                [sys.executable, "-m", "axon_nb.cluster.keeper", str(self.root),
                 str(os.getpid()), cluster_file, watch_dir, ",".join(map(str, roots)),
                 repr(idle_timeout)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        self.keeper_pid = keeper.pid
        self.keeper_started = records.process_start(keeper.pid)
        records.write_record(self.root, {
            "name": self.name, "started_at": time.time(), "options": {"n": n}, "ranks": [],
            "keeper_pid": keeper.pid, "keeper_started": self.keeper_started,
        })  # fmt: skip
        return keeper.pid

    def finish_start(
        self, cluster: Started, cluster_file: str, watch_dir: str, roots: list[int]
    ) -> None:
        """Have every rank keep its output and runs here, write the record, and hold this
        kernel's lease."""
        pids = cluster.run(entry.keep_runs, str(self.root), self.keeper_pid, stream=False)
        opts = cluster.options
        record = {
            "name": self.name,
            "version": records.version(),
            "code_hash": records.code_hash(),
            "started_at": time.time(),
            "options": {k: getattr(opts, k) for k in ("n", "engines", "backend", "gpus",
                        "timeout", "start_timeout", "hang_timeout", "idle_timeout")},
            "ranks": cluster.ranks,
            "pids": {str(r): pid for r, pid in enumerate(pids)},
            "pid_started": {str(r): records.process_start(pid) for r, pid in enumerate(pids)},
            "cluster_file": cluster_file,
            "watch_dir": watch_dir,
            "relay": relay_routes(cluster.client),
            "roots": roots,
            "keeper_pid": self.keeper_pid,
            "keeper_started": self.keeper_started,
        }  # fmt: skip
        records.write_record(self.root, record)
        self.hold_lease()

    def hold_lease(self) -> None:
        """Count this kernel as attached (until it exits or stops the cluster)."""
        records.hold_lease(self.root)

    def note_run(
        self, name: str, run: str, steps: int, targets: list[int], strategy: str, *,
        streams: bool = True,
    ) -> None:  # fmt: skip
        """Before run ``name`` goes to the ranks: who started it, for attaching kernels (the
        files of an earlier run of that name go); ``streams``: its ranks publish as they go
        (``metrics_interval_s > 0``)."""
        self.refuse_if_busy()
        directory = run_dir(self.root, name)
        directory.parent.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        started = {"run": run, "steps": steps, "targets": targets, "strategy": strategy,
                   "kernel_pid": os.getpid(), "started_at": time.time(),
                   "streams": streams}  # fmt: skip
        write_atomically(directory / "run.json", json.dumps(started).encode())
        for old in directory.iterdir():  # (the earlier run's stream and summaries)
            if old.name != "run.json":
                old.unlink(missing_ok=True)

    def busy_run(self) -> KeptRun | None:
        """A run in progress that another kernel started (work from this one would wait
        behind it), else None."""
        record = records.read_record(self.root)
        if record is None:
            return None
        for run in kept_runs(self.root, records.ranks_alive(record)):
            if run.running and run.kernel_pid != os.getpid():
                return run
        return None

    def refuse_if_busy(self) -> None:
        run = self.busy_run()
        if run is not None:
            whose = "a kernel that is gone" if not alive(run.kernel_pid) else "another kernel"
            raise AxonError(
                f"run {run.name!r} (step {run.step} of {run.steps}) is training on these ranks, "
                f"started by {whose} (pid {run.kernel_pid}): wait for it with "
                f"`cluster.handle({run.name!r}).wait()`, or stop it with "
                f"`cluster.handle({run.name!r}).stop()`, then send work"
            )

    def let_go(self) -> None:
        """This kernel leaves the cluster running (it exits, or detaches)."""
        records.release_lease(self.root)

    def end(self) -> None:
        """After the cluster's processes were ended: remove its record (the keeper exits),
        end the keeper, remove its directory."""
        with contextlib.suppress(OSError):
            (self.root / "cluster.json").unlink()
        pid = self.keeper_pid
        ours = pid is not None and records.same_process(pid, self.keeper_started)
        if ours and pid is not None and end_keeper(pid, KEEPER_END_S):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # (the starting kernel's child: reaped)
        shutil.rmtree(self.root, ignore_errors=True)


def relay_routes(client: Any) -> dict[str, list[str]]:
    """Each rank's host and relay address, so that a kernel attaching later sends through
    the relay without asking the ranks (they may be training: a request would wait)."""
    relay = relay_of(client)
    return {str(r): list(route) for r, route in relay.routes.items()} if relay else {}


def open_detached(name: str) -> tuple[Detached, dict[str, Any]]:
    """This user's running detached cluster ``name`` and its record, refused when it was
    started by another version or installation of axon_nb."""
    root = records.find(name)
    record = records.read_record(root)
    if record is None:
        raise AxonError(f"the detached cluster {name!r} stopped just now")
    theirs = (record["version"], record["code_hash"])
    ours = (records.version(), records.code_hash())
    if theirs != ours:
        raise AxonError(
            f"the detached cluster {name!r} runs axon_nb {theirs[0]} (code {theirs[1]}), this "
            f"kernel has axon_nb {ours[0]} (code {ours[1]}): attach from a kernel of the "
            f"same installation, or end it with axon_nb.stop_detached({name!r})"
        )
    return Detached(name, root, record["keeper_pid"], record.get("keeper_started")), record


def stop_detached(name: str) -> None:
    """End this user's detached cluster ``name`` without attaching (whatever code started
    it): its keeper ends every process and removes its files. Example::

        axon_nb.stop_detached("lab")
    """
    root = records.find(name)
    record = records.read_record(root)
    if record is None or not records.keeper_alive(record):
        return  # (it ended just now)
    pid = int(record["keeper_pid"])
    if not end_keeper(pid, 15):
        raise AxonError(f"the keeper of {name!r} (pid {pid}) did not end within 15 s")


def end_keeper(pid: int, seconds: float) -> bool:
    """SIGTERM keeper ``pid`` (it ends its cluster unless a kernel did) and wait up to
    ``seconds`` for it to exit; whether it did."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
