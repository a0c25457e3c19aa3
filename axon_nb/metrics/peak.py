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

The loop tracks the first two steps of each ``train`` call (the first creates the optimizer
state, the second is a steady one) and reports ``peak_bytes``: the larger of the two steps'
held bytes at their start (``metrics.memory.held_bytes``: model state and DDP's gradient
buckets) plus the most tracked bytes alive at once during the step (activations, gradients,
gathered FSDP parameters, communication buffers, optimizer temporaries).

Example::

    with PeakTracker() as tracker:
        model(x).sum().backward()
    tracker.peak  # bytes
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ACTIVE: list[PeakTracker] = []  # trackers to tell about a resize, innermost last
_LOCK = threading.Lock()
_RESIZE = torch.UntypedStorage.resize_


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while a tracker is active: resize, then tell the trackers."""
    before = storage.nbytes()
    result = _RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker._resized(storage, before)
    return result


class PeakTracker(TorchDispatchMode):
    """Most bytes of tensor storage allocated while active and alive at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage identity -> bytes counted for it
        self._before: dict[int, int] = {}  # bytes a storage had before this tracker saw it
        self._active = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def __enter__(self) -> PeakTracker:
        with _LOCK:
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
            _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._active = False
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _track(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        try:
            storage = local.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage (a wrapper subclass)
            return
        key = storage._cdata
        if key in self._live:  # an in-place result or a view; aten.resize_ may have grown it
            self._count(key, storage.nbytes())
        elif address != 0:
            self._start(storage, before=0)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """A storage went from ``before`` bytes to its size now. One this tracker has not seen
        was there before it started (``held_bytes`` has it): its change is what counts."""
        if storage._cdata in self._live:
            self._count(storage._cdata, storage.nbytes())
        else:
            self._start(storage, before)

    def _start(self, storage: torch.UntypedStorage, before: int) -> None:
        key = storage._cdata
        self._live[key] = 0
        self._before[key] = before
        self._count(key, storage.nbytes())
        weakref.finalize(storage, self._release, key)

    def _count(self, key: int, nbytes: int) -> None:
        counted = nbytes - self._before[key]
        self.current += counted - self._live[key]
        self._live[key] = counted
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        if self._active:
            self.current -= self._live.pop(key, 0)
            self._before.pop(key, None)
