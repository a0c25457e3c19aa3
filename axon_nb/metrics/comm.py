"""Measure the collectives a rank really issues: kind, payload bytes and time.

While a :class:`CommMeter` is installed, the ``torch.distributed`` collective functions are
wrapped, and so are the functional collectives of ``torch.distributed._functional_collectives``
that DTensor (tensor parallelism, loss parallelism) redistributes with. PyTorch's DDP comm
hooks, FSDP2, ZeroRedundancyOptimizer, pipelining and DTensor all call them through their
modules, so their traffic is counted as it happens, not from a formula.

What the figures mean:

- ``bytes``: the payload this rank hands to the collective (its input tensor, or the list's
  total); for ``all_gather`` the input shard, for ``recv`` the receive buffer.
- ``time_s``: wall time from the call until its result is ready. For ``async_op=True`` calls
  (DDP's buckets) that is until the work's future completes, so it includes time queued
  behind earlier buckets and overlaps backward compute. Functional collectives return before
  their result is waited for: their time is the launch only.
- Code compiled by ``torch.compile`` calls the collective ops directly: not counted.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

KINDS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "isend": "send_recv",
    "irecv": "send_recv",
}
"""Wrapped ``torch.distributed`` functions -> collective kind reported in the stream."""

PAYLOAD: dict[str, str] = {
    "all_reduce": "tensor",
    "all_gather": "tensor",  # (tensor_list is the output)
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",  # FSDP2 passes it by keyword
    "broadcast": "tensor",
    "all_to_all_single": "input",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
"""The parameter of each wrapped function that holds this rank's payload, found by binding
the call to the function's signature, so positional and keyword calls count alike."""

FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
"""Wrapped functional collectives (``torch.distributed._functional_collectives``) -> kind;
their payload is their first parameter, ``self``."""


class CommMeter:
    """Accumulates per-kind bytes, time and call count until :meth:`take` is called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}
        self._lifetime: dict[str, list[float]] = {}

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Record one finished collective (called from gloo/NCCL completion threads too)."""
        with self._lock:
            for table in (self._totals, self._lifetime):
                row = table.setdefault(kind, [0, 0.0, 0])
                row[0] += nbytes
                row[1] += seconds
                row[2] += 1

    def take(self) -> dict[str, dict[str, float]]:
        """Figures since the last ``take`` as ``{kind: {bytes, time_s, count}}``; resets them."""
        with self._lock:
            taken, self._totals = self._totals, {}
        return _as_dicts(taken)

    def totals(self) -> dict[str, dict[str, float]]:
        """Figures since the meter was created."""
        with self._lock:
            return _as_dicts(self._lifetime)

    @contextmanager
    def installed(self) -> Iterator[CommMeter]:
        """Wrap the ``torch.distributed`` collectives for the duration of the block."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        patched: list[tuple[Any, str, Any]] = []  # (module, name, original)
        for name in KINDS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(KINDS[name], Payload(name, fn), fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    patched.append((module, name, fn))
                    setattr(module, name, wrapped)
        for name, kind in FUNCTIONAL.items():
            fn = getattr(funcol, name, None)
            if fn is not None:
                patched.append((funcol, name, fn))
                setattr(funcol, name, self._wrap(kind, Payload(name, fn, "self"), fn))
        try:
            yield self
        finally:
            for module, name, fn in patched:
                setattr(module, name, fn)

    def _wrap(self, kind: str, payload: Payload, fn: Callable[..., Any]) -> Callable[..., Any]:

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            nbytes = payload.nbytes(args, kwargs)
            start = time.perf_counter()
            work = fn(*args, **kwargs)
            if work is None or not hasattr(work, "get_future"):
                self.add(kind, nbytes, time.perf_counter() - start)
                return work
            done = lambda *_: self.add(kind, nbytes, time.perf_counter() - start)  # noqa: E731
            try:
                work.get_future().add_done_callback(done)
            except RuntimeError:  # gloo's reduce-scatter work has no future: time its wait()
                return _TimedWork(work, done)
            return work

        return measured


class _TimedWork:
    """A ``Work`` whose ``wait()`` also records the collective as done."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work, self._done = work, done

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        if self._done is not None:
            self._done()
            self._done = None
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Payload:
    """Reads this rank's payload bytes from a call of ``torch.distributed.<name>``.

    Example::

        Payload("reduce_scatter_tensor", dist.reduce_scatter_tensor).nbytes((), {"output": out,
                                                                                 "input": x})
    """

    def __init__(self, name: str, fn: Callable[..., Any], parameter: str | None = None) -> None:
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one: positions of the default API
            self.signature = None
        params = self.signature.parameters if self.signature is not None else {}
        self.parameter = (
            parameter or PAYLOAD.get(name) or ("tensor" if "tensor" in params else None)
        )
        self.position = _DEFAULT_POSITIONS.get(self.parameter or "", 0)

    def nbytes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if self.parameter is None:
            return 0
        if self.signature is not None:
            try:
                bound = self.signature.bind_partial(*args, **kwargs)
            except TypeError:
                return 0
            return _nbytes(bound.arguments.get(self.parameter))
        if self.parameter in kwargs:
            return _nbytes(kwargs[self.parameter])
        return _nbytes(args[self.position]) if len(args) > self.position else 0


_DEFAULT_POSITIONS = {"self": 0, "tensor": 0, "input_tensor": 1, "input": 1, "input_list": 1}


def _nbytes(value: Any) -> int:
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    numel = getattr(value, "numel", None)
    return int(numel() * value.element_size()) if numel is not None else 0


def _as_dicts(table: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        kind: {"bytes": int(row[0]), "time_s": row[1], "count": int(row[2])}
        for kind, row in table.items()
    }
