"""The collective this rank is in, or was last in: what a hang report shows beside the stacks.

:func:`install` wraps the ``torch.distributed`` collectives once, for the life of the rank
(the bootstrap calls it). Each call overwrites one module-level record (kind, this rank's
sequence number, group, bytes, start, end), so keeping it costs a few attribute writes per
collective and no I/O. :func:`current` reads it as plain data, from any thread.

This is the one place that wraps collectives: while a metrics meter is set
(``comm.CommMeter.installed``, during training) each call is also measured for it (kind,
payload bytes, time), and so are the functional collectives DTensor redistributes with.

A collective called from inside another (``all_gather_object`` calls ``all_gather``) is
recorded once, as the outer one.

Example (in a ``%%axon`` cell)::

    from axon_nb.metrics import collective
    dist.all_reduce(torch.ones(4))
    collective.current()   # {"kind": "all_reduce", "seq": 1, "bytes": 16, "done": True, ...}
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from axon_nb.metrics.payload import FUNCTIONAL, KINDS, Payload

TRACKED: tuple[str, ...] = (
    *KINDS,
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
)
"""``torch.distributed`` functions recorded (those the metrics meter measures, and more)."""

_PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
"""Point-to-point functions -> the keyword naming the peer (also their second argument)."""


class _Record:
    """One collective call. Written by the calling thread; read, never written, by others."""

    __slots__ = (
        "async_op", "end", "failed", "group", "kind", "nbytes", "peer", "seq", "start", "thread"
    )  # fmt: skip

    def __init__(
        self, kind: str, seq: int, group: Any, nbytes: int | None, peer: int | None
    ) -> None:
        self.kind, self.seq, self.group, self.nbytes, self.peer = kind, seq, group, nbytes, peer
        self.start = time.monotonic()
        self.end: float | None = None
        self.async_op = False
        self.failed = False
        self.thread = threading.get_ident()


_last: _Record | None = None
_seq = 0
_local = threading.local()
_installed = False
_meter: Any = None
"""The metrics meter calls are measured for (``comm.CommMeter``), while one is set."""


def set_meter(meter: Any) -> Any:
    """Measure every collective for ``meter`` (None: stop); the previous meter."""
    global _meter
    previous, _meter = _meter, meter
    return previous


def install() -> None:
    """Record every call of the tracked ``torch.distributed`` functions from now on.

    Idempotent. Wrapping the module attributes (and ``distributed_c10d``'s, which is where
    torch's own callers look them up) reaches DDP's hooks, FSDP and user code alike.
    """
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    for name in TRACKED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        wrapped = _wrap(name, fn)
        setattr(dist, name, wrapped)
        if getattr(c10d, name, None) is fn:
            setattr(c10d, name, wrapped)
    for name, kind in FUNCTIONAL.items():
        fn = getattr(funcol, name, None)
        if fn is not None:
            setattr(funcol, name, _wrap_functional(kind, Payload(name, fn, "self"), fn))
    _installed = True


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    at = params.index("group") if "group" in params else None  # found once, not per call
    payload = None if name in _NO_BYTES else Payload(name, fn)
    measure = payload is not None and name in KINDS  # for the meter (else: recorded only)
    kind = KINDS.get(name, name)

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        global _last, _seq
        meter = _meter if measure else None
        inside = getattr(_local, "inside", False)
        if inside and meter is None:
            return fn(*args, **kwargs)
        nbytes = payload.nbytes(args, kwargs) if payload is not None else None
        if inside:  # inside another collective: measured, but the outer one is the record
            return _measured(meter, kind, nbytes or 0, fn, args, kwargs)
        _seq += 1
        group = kwargs.get("group")
        if group is None and at is not None and len(args) > at:
            group = args[at]
        record = _Record(name, _seq, group, nbytes, _peer(name, args, kwargs))
        _last = record
        start = time.perf_counter()
        _local.inside = True
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            record.failed = True
            raise
        finally:
            _local.inside = False
            record.end = time.monotonic()
        if meter is not None:
            meter.launched(kind, nbytes or 0)
        if work is None:  # done: the meter's time is now
            if meter is not None:
                meter.finished(kind, time.perf_counter() - start)
            return work
        # async_op=True, isend/irecv, batch_isend_irecv: pending work
        return _follow(work, record, meter, kind, start)

    return tracked


def _wrap_functional(kind: str, payload: Payload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A functional collective: measured for the meter only (it returns before its result is
    waited for, so its time is the launch)."""

    @functools.wraps(fn)
    def measured(*args: Any, **kwargs: Any) -> Any:
        meter = _meter
        if meter is None:
            return fn(*args, **kwargs)
        return _measured(meter, kind, payload.nbytes(args, kwargs), fn, args, kwargs)

    return measured


def _measured(
    meter: Any, kind: str, nbytes: int, call: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """``call(*args, **kwargs)`` measured for ``meter``: its bytes and count once it returns,
    its time when its result is ready (at once, or when its work completes)."""
    start = time.perf_counter()
    work = call(*args, **kwargs)
    meter.launched(kind, nbytes)
    if work is None or not hasattr(work, "get_future"):  # (a functional one's tensor)
        meter.finished(kind, time.perf_counter() - start)
        return work
    return _follow(work, None, meter, kind, start)


def _follow(work: Any, record: _Record | None, meter: Any, kind: str, start: float) -> Any:
    """``work``, with the ``record``'s end and the ``meter``'s time set when it completes: by
    one callback on its future (each one a trip through the interpreter's lock from a gloo or
    NCCL thread), else when it is waited for (gloo's reduce-scatter has no future)."""
    last = work[-1] if isinstance(work, list) and work else work
    if not hasattr(last, "wait"):
        if meter is not None:
            meter.finished(kind, time.perf_counter() - start)
        return work
    if record is not None:
        record.async_op = True
    try:
        future = last.get_future()
    except AttributeError:  # not a Work: the record takes it as done, and so does the meter
        if meter is not None:
            meter.finished(kind, time.perf_counter() - start)
        return work
    except RuntimeError:  # no future (gloo's reduce-scatter): the record takes it as done
        if meter is None:
            return work
        return _TimedWork(work, lambda: meter.finished(kind, time.perf_counter() - start))
    if record is not None:
        record.end = None

    def done(_: Any) -> None:
        if record is not None:
            record.end = time.monotonic()
        if meter is not None:
            meter.finished(kind, time.perf_counter() - start)

    future.add_done_callback(done)
    return work


class _TimedWork:
    """A ``Work`` whose ``wait()`` also reports the collective as done."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work = work
        self._done: Callable[[], None] | None = done

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        if self._done is not None:
            self._done()
            self._done = None
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_NO_BYTES = frozenset(name for name in TRACKED if "object" in name or "barrier" in name) | {
    "batch_isend_irecv"
}
"""Functions whose payload is not a tensor argument (objects pickled inside, barriers, P2P ops)."""


def _peer(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    key = _PEER_ARG.get(name)
    if key is None:
        return None
    peer = kwargs.get(key, args[1] if len(args) > 1 else None)
    return peer if isinstance(peer, int) else None


def current() -> dict[str, Any] | None:
    """The current or last collective of this rank as plain data; None before the first.

    Keys: ``kind`` (the function called), ``seq`` (this rank's count of collectives so far),
    ``group`` (its global ranks, None for the whole world), ``group_size``, ``bytes`` (None
    where unknown), ``peer`` (send/recv), ``async_op``, ``done``, ``failed`` (it raised),
    ``age_s`` (since it started), ``took_s`` (once done), ``main_thread`` (issued by the
    rank's main thread) and ``backend`` (its group's). On NCCL, ``done`` means the host call
    returned: the GPU runs the collective after that, and a rank's host thread waits for it
    later (at ``.item()``, a synchronize, ...).
    """
    record = _last
    if record is None:
        return None
    import torch.distributed as dist

    ranks, size, backend = None, None, None
    if dist.is_initialized():
        with contextlib.suppress(ValueError, RuntimeError):  # (a group destroyed since)
            backend = str(dist.get_backend(record.group))
        if record.group is None:
            size = dist.get_world_size()
        else:
            try:
                ranks = dist.get_process_group_ranks(record.group)
                size = len(ranks)
            except (ValueError, RuntimeError):  # a group destroyed since
                pass
            if ranks == list(range(dist.get_world_size())):
                ranks = None  # the whole world, under another group object
    end, now = record.end, time.monotonic()
    return {
        "kind": record.kind,
        "seq": record.seq,
        "group": ranks,
        "group_size": size,
        "bytes": record.nbytes,
        "peer": record.peer,
        "async_op": record.async_op,
        "done": end is not None,
        "failed": record.failed,
        "age_s": now - record.start,
        "took_s": None if end is None else end - record.start,
        "main_thread": record.thread == threading.main_thread().ident,
        "backend": backend,
    }
