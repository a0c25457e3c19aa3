"""Peak tensor memory on CPU ranks, where there is no allocator to ask (CUDA has
``torch.cuda.max_memory_allocated``).

``PeakTracker`` is a ``TorchDispatchMode``: every tensor an operator returns while it is active
is looked at, and each storage seen for the first time is counted until it is freed (a
finalizer on the storage object, which PyTorch keeps alive exactly as long as the storage).
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

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTracker(TorchDispatchMode):
    """Most bytes of tensor storage allocated while active and alive at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[int, weakref.ref[Any], int]] = {}
        """data_ptr -> (bytes, the storage, serial of this entry)"""
        self._serial = 0
        self._active = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def __exit__(self, *exc: object) -> None:
        self._active = False
        super().__exit__(*exc)

    def _track(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        try:
            storage = local.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage (a wrapper subclass)
            return
        if key == 0:  # empty
            return
        seen = self._live.get(key)
        if seen is not None:
            if seen[1]() is storage:  # an in-place result, or a view
                return
            # Another storage at a counted address: the counted one gave its memory back
            # without dying (FSDP frees a gathered parameter with ``resize_(0)``).
            self._release(key, seen[2])
        self._serial += 1
        self._live[key] = (storage.nbytes(), weakref.ref(storage), self._serial)
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key, self._serial)

    def _release(self, key: int, serial: int) -> None:
        seen = self._live.get(key)
        if self._active and seen is not None and seen[2] == serial:
            del self._live[key]
            self.current -= seen[0]
