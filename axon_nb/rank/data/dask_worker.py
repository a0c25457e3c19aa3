"""A dask worker inside this rank's engine process, so dask work runs where training runs.

The worker lives on the engine's event loop (as ipyparallel's ``become_dask`` puts it) and
listens on this rank's address toward the scheduler (loopback when the cluster is on one
host). What it computes for training stays in this process: the loop reads it from the
worker's memory (``axon_nb.rank.data.dask_shard``), never over a socket.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from axon_nb.spec.bootstrap_spec import address_toward


def start_worker(scheduler: str, name: str) -> None:
    """Start (without waiting) a one-thread worker named ``name`` connected to ``scheduler``;
    a worker this engine already runs for the same scheduler is kept."""
    from distributed import Worker
    from IPython import get_ipython

    shell = get_ipython()
    current = shell.user_ns.get("dask_worker")
    if current is not None and current.status.name in ("init", "running"):
        if current.scheduler.address == scheduler:
            return
        _keep(asyncio.ensure_future(current.close()))
    host = address_toward(urlsplit(scheduler).hostname or "127.0.0.1")
    worker = Worker(
        scheduler,
        name=name,
        host=host,
        nthreads=1,
        dashboard=False,  # its own page would listen too; the scheduler's dashboard shows it
        memory_limit=0,  # the rank's memory is training's: no pausing or spilling by dask
    )
    shell.user_ns["dask_worker"] = worker
    future = _keep(asyncio.ensure_future(worker.start()))
    future.add_done_callback(_log_failure)


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
