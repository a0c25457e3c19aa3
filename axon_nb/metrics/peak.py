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
        self._live: dict[int, int] = {}
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
        if key == 0 or key in self._live:  # empty, or an in-place result / view
            return
        self._live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        if self._active:
            self.current -= self._live.pop(key, 0)
