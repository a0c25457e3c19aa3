"""A rank's engine process: ipyparallel's engine, with torch imported on a side thread while
the engine connects and registers, and (where the warm process loaded what it needs) its
nanny forked from it (``rank/world/forked_nanny.py``).

Importing torch is most of a rank's start-up (about 1.4 s of CPU here); done after
registration, the first cell waits for it. The side thread overlaps it with the engine's own
imports and its registration with the controller, so the world is joined as soon as the
engines are. The import runs off the main thread, so a Ctrl-C cannot land inside it (see
``rank/world/interrupts.py``). Usage (what ``cluster/launchers.py`` configures)::

    python -m axon_nb.rank.world.launch python -m axon_nb.rank.world.engine --mpi
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading

from axon_nb.spec.world_change import ID_BASE_ENV


def _import_torch() -> None:
    # A failure is reported where torch is first used, on the main thread.
    with contextlib.suppress(Exception):
        import torch.distributed  # noqa: F401


def main() -> None:
    from axon_nb.rank.world.forked_nanny import ForkedNanny

    report_crashes()

    nanny = ForkedNanny.fork()  # (first: one thread, no socket yet)
    threading.Thread(target=_import_torch, name="axon-import-torch", daemon=True).start()
    from ipyparallel.engine.app import main as engine_main

    from axon_nb import ipykernel_sigint

    ipykernel_sigint.install(hold_during_imports=True)  # Ctrl-C never ends the engine
    if nanny is not None:
        nanny.replace_ipyparallel_start()
    _request_engine_id()

    try:
        engine_main()
    except RuntimeError:
        if not _asked_to_shut_down():
            raise


def report_crashes() -> None:
    """Have a crash in native code (a segfault, an abort) print the Python stack it happened
    in (the crashing thread's) to this process's stderr as it is now: the cluster's log. Not
    to what ``sys.stderr`` is at the crash: ipykernel's output stream puts a pipe on
    descriptor 2, read by a thread of this process, which dies with it unread."""
    stderr = os.fdopen(os.dup(2), "w")  # (faulthandler keeps it; not inherited)
    faulthandler.enable(file=stderr, all_threads=False)


def _request_engine_id() -> None:
    """Under :data:`ID_BASE_ENV`, ask for engine id ``base`` + this process's rank in its
    launch (``PMI_RANK`` from MPICH's process managers; Open MPI's and PMIx's names too)."""
    base = os.environ.get(ID_BASE_ENV)
    if base is not None:
        ranks = (os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
        engine_id = int(base) + int(next((r for r in ranks if r is not None), "0"))
        sys.argv.append(f"--IPEngine.id={engine_id}")


def _asked_to_shut_down() -> bool:
    """True when the engine ended on a shutdown request (a clean stop). ipykernel answers it
    by stopping the IO loop under ipyparallel's ``run_sync``, which then raises "Event loop
    stopped before Future completed": without this, every cleanly stopped engine printed that
    traceback to the cluster's log and exited 1 (and MPI's launcher, seeing a rank fail,
    interrupted the others and lingered two seconds)."""
    from ipyparallel.engine.app import IPEngine

    if not IPEngine.initialized():
        return False
    kernel = getattr(IPEngine.instance(), "kernel", None)
    return getattr(kernel, "_shutdown_message", None) is not None  # set by shutdown_request


if __name__ == "__main__":
    main()
