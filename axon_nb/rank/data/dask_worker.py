"""A dask worker inside this rank's engine process, so dask work runs where training runs.

The worker lives on the engine's event loop (as ipyparallel's ``become_dask`` puts it) and
listens on this rank's address toward the scheduler (loopback when the cluster is on one
host). What it computes for training stays in this process: the loop reads it from the
worker's memory (``axon_nb.rank.data.dask_shard``), never over a socket.

It speaks TLS only, with the certificate the kernel sent (``cluster/dask_tls.py``); its HTTP
server serves no route and listens on loopback; its scratch directory (locks, spilled data)
is a new owner-only directory, under the cluster's where that is on this host, never dask's
shared ``dask-scratch-space`` in the system's temporary directory.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from typing import Any
from urllib.parse import urlsplit

from axon_nb.spec.bootstrap_spec import address_toward
from axon_nb.spec.dask_security import NO_HTTP_ROUTES, security_from_pem


def start_worker(
    scheduler: str, name: str, pem: tuple[str, str, str], private_dir: str | None = None
) -> None:
    """Start (without waiting) a one-thread worker named ``name`` connected to ``scheduler``
    with the authority, certificate and key ``pem``; a worker this engine already runs for
    the same scheduler is kept."""
    import dask
    from distributed import Worker
    from IPython import get_ipython

    shell = get_ipython()
    current = shell.user_ns.get("dask_worker")
    if current is not None and current.status.name in ("init", "running"):
        if current.scheduler.address == scheduler:
            return
        _keep(asyncio.ensure_future(current.close()))
    host = address_toward(urlsplit(scheduler).hostname or "127.0.0.1")
    dask.config.set(NO_HTTP_ROUTES)
    worker = Worker(
        scheduler,
        name=name,
        host=host,
        protocol="tls",
        security=security_from_pem(*pem, role="worker"),
        nthreads=1,
        dashboard=False,  # its own page would listen too; the scheduler's dashboard shows it
        dashboard_address="127.0.0.1:0",  # (dask's HTTP server starts anyway: no routes)
        local_directory=_scratch(private_dir),
        memory_limit=0,  # the rank's memory is training's: no pausing or spilling by dask
    )
    shell.user_ns["dask_worker"] = worker
    future = _keep(asyncio.ensure_future(worker.start()))
    future.add_done_callback(_log_failure)


def stop_worker() -> None:
    """Close this engine's worker, if it has one (without waiting)."""
    from IPython import get_ipython

    worker = get_ipython().user_ns.pop("dask_worker", None)
    if worker is not None:
        _keep(asyncio.ensure_future(worker.close()))


def _scratch(private_dir: str | None) -> str:
    """A new owner-only directory (``mkdtemp`` makes it 0700 with a random name) for the
    worker's files, removed when this process exits."""
    path = tempfile.mkdtemp(prefix="axon-dask-", dir=private_dir)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def local_data(key: Any) -> Any:
    """The value the worker in this process holds under ``key`` (raises ``KeyError``)."""
    from IPython import get_ipython

    worker = get_ipython().user_ns.get("dask_worker")
    if worker is None:
        raise KeyError(key)
    return worker.data[key]


_RUNNING: set[asyncio.Future[Any]] = set()
"""Tasks started on the engine's loop, referenced until they end (the loop keeps only weak
references)."""


def _keep(future: asyncio.Future[Any]) -> asyncio.Future[Any]:
    _RUNNING.add(future)
    future.add_done_callback(_RUNNING.discard)
    return future


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        import sys

        print(f"axon_nb: the dask worker did not start: {future.exception()}", file=sys.stderr)
