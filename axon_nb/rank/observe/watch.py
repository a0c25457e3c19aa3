"""Answer "where is this rank now?" while its main thread is busy or stuck.

An engine runs tasks on its main thread one at a time, so a busy rank cannot be asked by
sending it a task, and a Python signal handler does not run while the main thread waits in a
C call (gloo, NCCL). So :func:`start` runs a daemon thread, ``axon-watch``, that polls the
cluster's owner-only watch directory: when the kernel writes a new number into ``request``,
the thread writes ``stacks-<rank>.json`` with every thread's Python stack and this rank's
current or last collective (:mod:`axon_nb.metrics.collective`). torch.distributed releases
the GIL while it waits, so the thread runs then.

For a rank whose main thread holds the GIL in native code, the thread cannot run either;
:func:`start` also registers ``faulthandler`` on ``SIGUSR1``, which dumps every thread's
stack from C into ``native-<rank>.txt`` when the kernel sends that signal.

The file layout is shared with the kernel (``axon_nb/cluster/stacks.py``)::

    request               the latest request number, written by the kernel
    stacks-<rank>.json    {"request": n, "rank", "pid", "host", "threads": [...],
                           "collective": {...} | None}
    native-<rank>.txt     faulthandler's dumps, appended
"""

from __future__ import annotations

import faulthandler
import functools
import json
import linecache
import os
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from axon_nb.metrics import collective
from axon_nb.spec.signals import NATIVE_SIGNAL

POLL_S = 0.15
"""How often the watch thread looks for a new request."""

_thread: threading.Thread | None = None
_native_file: Any = None


def start(directory: str, rank: int) -> None:
    """Start answering stack requests in ``directory`` as ``rank`` (idempotent)."""
    global _thread, _native_file
    collective.install()
    if _thread is not None and _thread.is_alive():
        return
    folder = Path(directory)
    if threading.current_thread() is threading.main_thread():
        # Append mode: the kernel reads each dump from the size the file had before it asked.
        _native_file = open(folder / f"native-{rank}.txt", "a")  # noqa: SIM115 (held open)
        faulthandler.register(NATIVE_SIGNAL, file=_native_file, all_threads=True)
    _thread = threading.Thread(target=_serve, args=(folder, rank), name="axon-watch", daemon=True)
    _thread.start()


def _serve(folder: Path, rank: int) -> None:
    request = folder / "request"
    answered = _read_request(request)  # requests made before this rank started are stale
    while folder.is_dir():
        time.sleep(POLL_S)
        number = _read_request(request)
        if number is None or number == answered:
            continue
        answered = number
        try:
            answer = report(rank, request=number)
        except Exception as e:  # never let the watch thread die; say what failed instead
            answer = {"request": number, "rank": rank, "error": f"{type(e).__name__}: {e}"}
        try:
            _write_json(folder / f"stacks-{rank}.json", answer)
        except OSError:  # the cluster is being stopped (its directory removed)
            continue


def _read_request(path: Path) -> int | None:
    try:
        return int(path.read_text() or "0")
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)  # the kernel never reads half a report


def report(rank: int, *, request: int = 0) -> dict[str, Any]:
    """Every thread's stack (but the watch thread's) and the current collective, as JSON data.

    Example::

        report(0)["threads"][0]["frames"][-1]   # ["train.py", 42, "load_batch", "...", True]
    """
    me = threading.get_ident()
    main = threading.main_thread().ident
    names = {t.ident: t for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        thread = names.get(ident)
        threads.append(
            {
                "name": thread.name if thread is not None else f"thread {ident}",
                "main": ident == main,
                "daemon": bool(thread is not None and thread.daemon),
                "frames": frames(frame),
            }
        )
    threads.sort(key=lambda t: (not t["main"], t["name"]))
    return {
        "request": request,
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "threads": threads,
        "collective": collective.current(),
    }


def frames(frame: FrameType | None) -> list[list[Any]]:
    """``frame``'s stack, outermost first, as ``[filename, line, function, source, user]``.

    ``user`` is False for frames of the standard library, installed packages and axon_nb.
    """
    stack = []
    while frame is not None:
        code = frame.f_code
        filename, line = code.co_filename, frame.f_lineno or 0
        source = linecache.getline(filename, line).strip()
        stack.append([filename, line, code.co_name, source, is_user_code(filename)])
        frame = frame.f_back
    stack.reverse()
    return stack


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(collective.__file__).resolve().parents[1]))  # the axon_nb package
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


_LIBRARY = _library_roots()


@functools.lru_cache(maxsize=4096)
def is_user_code(filename: str) -> bool:
    """False for the standard library, installed packages, axon_nb, frozen modules and the
    ``<string>`` through which the engine calls a task's function."""
    if filename.startswith("<frozen") or filename == "<string>":
        return False
    return not os.path.realpath(filename).startswith(_LIBRARY)
