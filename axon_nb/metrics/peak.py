"""Peak tensor memory on CPU ranks, where there is no allocator to ask (CUDA has
``torch.cuda.max_memory_allocated``).

``PeakTracker`` is a ``TorchDispatchMode``: every tensor an operator returns while it is active
is looked at, and each storage seen for the first time is counted until it is freed (a
finalizer on the storage object, which PyTorch keeps alive exactly as long as the storage).
A storage is known by its identity, not its address: FSDP frees and re-allocates the memory of
its unsharded parameters with ``UntypedStorage.resize_``, which no operator sees and which moves
the address, so the tracker also follows every storage resize made while it is active (by
wrapping ``resize_``, as PyTorch's own ``MemTracker`` does). Counting by address counted each
re-gathered parameter again wherever the allocator put it somewhere new, so the peak depended
on where ``malloc`` placed memory (x0.89 to x1.11 between identical runs).

Only storage an operator makes is counted: a view of older storage (a ``Linear``'s transposed
weight) or an in-place result (the optimizer's update of a parameter) is storage the step
found, which ``held_bytes`` has already counted.

The loop tracks the first and the third step of each ``train`` call (the first creates the
optimizer state, the third is a steady one; in the second DDP rebuilds its buckets, and the
old ones' freeing is out of the tracker's sight) and reports ``peak_bytes``: the larger of
the two steps' held bytes at their start (``metrics.memory.held_parts``: parameters,
gradients, optimizer state and DDP's gradient buckets) plus the most tracked bytes alive at
once during the step (activations, gradients, gathered FSDP parameters, communication
buffers, optimizer temporaries), with the phase that held it (``peak_phase``: forward,
backward, step, or pipeline for a schedule's interleaved ones, marked by the loop with
:func:`mark_phase`), each phase's own most (``peak_by_phase``) and the bytes by part
(``peak_parts``, :meth:`PeakTracker.breakdown`).

Example::

    with PeakTracker() as tracker:
        model(x).sum().backward()
    tracker.peak  # bytes
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ACTIVE: list[PeakTracker] = []  # trackers to tell about a resize, innermost last
_LOCK = threading.Lock()
_RESIZE = torch.UntypedStorage.resize_
_FRESH: dict[Any, bool] = {}  # operator -> whether its outputs are new storage
_SHARING = {"_unsafe_view"}  # operators that return their input's storage, unannotated


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while a tracker is active: resize, then tell the trackers."""
    before = storage.nbytes()
    result = _RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker._resized(storage, before)
    return result


def _use_resize(resize: Callable[..., Any]) -> None:
    """Make ``resize`` every storage's ``resize_``: :func:`_resize`, or torch's own again."""
    torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]  # (a monkeypatch)


def mark_phase(phase: str) -> None:
    """Tell the active trackers that the step is now in ``phase`` (``forward``,
    ``backward``, ``step``): new storage is counted under it, and the peak says which phase
    held it. Costs nothing when no tracker is active."""
    for tracker in _ACTIVE:
        tracker.phase = phase
        tracker._marks.append((tracker._seq, phase))
        tracker._note_phase_peak()


@contextlib.contextmanager
def attributed(kind: str) -> Iterator[None]:
    """Storage made inside this block is of ``kind`` (``buckets``, ``communication``, ...)
    in the trackers' breakdowns, whatever the phase."""
    saved = [(tracker, tracker.kind) for tracker in _ACTIVE]
    for tracker, _ in saved:
        tracker.kind = kind
    try:
        yield
    finally:
        for tracker, kind_before in saved:
            tracker.kind = kind_before


def _fresh(func: Any) -> bool:
    """Whether ``func``'s outputs are storage it made: not a view of an input, not an input
    written in place (the schema's alias annotations say which; ``c10d``'s collectives,
    which return the tensors they were given, have none)."""
    known = _FRESH.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        returns = schema.returns if schema is not None else []
        own = getattr(func, "namespace", "") != "c10d"
        own = own and schema is not None and schema.name.split("::")[-1] not in _SHARING
        known = _FRESH[func] = own and all(r.alias_info is None for r in returns)
    return known


class PeakTracker(TorchDispatchMode):
    """Most bytes of tensor storage allocated while active and alive at the same time, the
    phase that held them (``peak_phase``) and, by :meth:`breakdown`, what they were."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.phase = "forward"
        """The step's phase now (:func:`mark_phase`)."""
        self.kind: str | None = None
        """What storage made now is, when not the phase's default (:func:`attributed`)."""
        self.peak_phase = "forward"
        self.phase_peaks: dict[str, int] = {self.phase: 0}
        """The most bytes alive at once while each phase ran (from its start, so what the
        phase before left alive counts). Forward and backward often come within a few percent
        of each other: this says how near the peak's phase came to losing it."""
        self._live: dict[int, int] = {}  # storage identity -> bytes counted for it
        self._before: dict[int, int] = {}  # bytes a storage had before this tracker saw it
        self._rows: dict[int, _Row] = {}  # storage identity -> its row, while alive
        self._done: list[_Row] = []
        self._seq = 0
        self._peak_seq = 0
        self._marks: list[tuple[int, str]] = [(0, self.phase)]  # (from event, phase)
        self._finalizers: list[weakref.finalize] = []
        self._active = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh = _fresh(func)
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value, fresh)
        return out

    def __enter__(self) -> PeakTracker:
        with _LOCK:
            if not _ACTIVE:
                _use_resize(_resize)
            _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._active = False
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _use_resize(_RESIZE)
        super().__exit__(*exc)

    def close(self) -> None:
        """Let go of the storages seen and their history (after reading :meth:`breakdown`):
        otherwise their finalizers keep this tracker alive as long as any of them lives."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        self._rows.clear()
        self._done.clear()
        self._live.clear()
        self._before.clear()

    def label(self, tensor: torch.Tensor | None, kind: str) -> None:
        """Count ``tensor``'s storage as ``kind`` in :meth:`breakdown` (if this tracker
        counts it)."""
        if tensor is None:
            return
        local = getattr(tensor, "_local_tensor", tensor)
        row = self._rows.get(local.untyped_storage()._cdata)
        if row is not None:
            row.kind = kind

    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak by what they were: the kind they were made as or labelled
        (:meth:`label`), else their phase's (``forward``: activations; ``backward``:
        activation gradients and gradients on their way; ``step``: step temporaries),
        ``gathered`` for storage grown by a resize (FSDP's whole parameters)."""
        figures: dict[str, int] = {}
        for row in [*self._done, *self._rows.values()]:
            counted = row.at(self._peak_seq)
            if counted:
                kind = row.kind or _PHASE_KIND.get(row.phase, row.phase)
                figures[kind] = figures.get(kind, 0) + counted
        return figures

    def peak_excluding(self, kind: str) -> int:
        """The most bytes alive at once leaving out storage of ``kind`` (labelled or made as
        it): e.g. a step's peak without its parameter gradients."""
        return self.moment_excluding(kind)[0]

    def moment_excluding(self, kind: str) -> tuple[int, str]:
        """:meth:`peak_excluding` and the phase it came in."""
        events = sorted(
            (when, value - before)
            for row in [*self._done, *self._rows.values()]
            if row.kind != kind
            for (when, value), before in zip(
                row.changes, [0, *(v for _, v in row.changes)], strict=False
            )
        )
        current = peak = peak_seq = 0
        for when, delta in events:
            current += delta
            if current > peak:
                peak, peak_seq = current, when
        return peak, next(p for seq, p in reversed(self._marks) if seq < max(peak_seq, 1))

    def _track(self, tensor: torch.Tensor, fresh: bool = True) -> None:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        try:
            storage = local.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage (a wrapper subclass)
            return
        key = storage._cdata
        if key in self._live:  # an in-place result or a view; aten.resize_ may have grown it
            self._count(key, storage.nbytes())
        elif address != 0 and fresh:  # (a view or in-place result of older storage: held)
            self._start(storage, before=0)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """A storage went from ``before`` bytes to its size now. One this tracker has not seen
        was there before it started (``held_bytes`` has it): its change is what counts."""
        if storage._cdata in self._live:
            self._count(storage._cdata, storage.nbytes())
        else:
            self._start(storage, before, kind="gathered")

    def _start(self, storage: torch.UntypedStorage, before: int, kind: str | None = None) -> None:
        key = storage._cdata
        self._live[key] = 0
        self._before[key] = before
        self._rows[key] = _Row(self.phase, kind or self.kind)
        self._count(key, storage.nbytes())
        self._finalizers.append(weakref.finalize(storage, self._release, key))

    def _count(self, key: int, nbytes: int) -> None:
        counted = nbytes - self._before[key]
        self._seq += 1
        self.current += counted - self._live[key]
        self._live[key] = counted
        self._rows[key].changes.append((self._seq, counted))
        self._note_phase_peak()
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
            self._peak_seq = self._seq

    def _note_phase_peak(self) -> None:
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current

    def _release(self, key: int) -> None:
        if self._active:
            self._seq += 1
            self.current -= self._live.pop(key, 0)
            self._before.pop(key, None)
            row = self._rows.pop(key, None)
            if row is not None:
                row.changes.append((self._seq, 0))
                self._done.append(row)


_PHASE_KIND = {"forward": "activations", "backward": "backward", "step": "step temporaries"}


class _Row:
    """One storage's history: the bytes counted for it from each event on."""

    __slots__ = ("changes", "kind", "phase")

    def __init__(self, phase: str, kind: str | None) -> None:
        self.phase = phase
        self.kind = kind
        self.changes: list[tuple[int, int]] = []

    def at(self, seq: int) -> int:
        counted = 0
        for when, value in self.changes:
            if when > seq:
                break
            counted = value
        return counted
