"""Batches copied to the GPU one step ahead, on a side stream, while the current step runs.

On a CUDA rank, step ``s + 1``'s micro-batches are taken from the loader (pinned memory) and
their copies queued on a second stream before step ``s`` is handed to the loop, so the copy
overlaps step ``s``'s kernels instead of preceding step ``s + 1``'s. Elsewhere (CPU ranks)
the batches are only moved to the device: there is nothing to overlap.

Example::

    for microbatches in prefetched(batches.from_step(0), torch.device("cuda", 0)):
        ...  # tensors already on the GPU, safe to use on the current stream
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from axon_nb.rank.data.structure import map_tensors, tensors


def prefetched(steps: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """The items of ``steps`` (batches of any structure) on ``device``."""
    if device.type != "cuda":
        for item in steps:
            yield to_device(item, device)
        return
    side = torch.cuda.Stream(device)

    def start(item: Any) -> Any:
        with torch.cuda.stream(side):
            return to_device(item, device)

    ready = None
    for item in steps:
        following = start(item)
        if ready is not None:
            yield _claimed(ready, side)
        ready = following
    if ready is not None:
        yield _claimed(ready, side)


def _claimed(item: Any, side: torch.cuda.Stream) -> Any:
    """``item``, usable on the current stream: it waits for the copies, and the caching
    allocator keeps their memory until the current stream is done with it."""
    current = torch.cuda.current_stream(side.device)
    current.wait_stream(side)
    for tensor in tensors(item):
        tensor.record_stream(current)
    return item


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it moved to ``device``, whatever its structure
    (``axon_nb.rank.data.structure``; ``non_blocking``: asynchronous from pinned memory)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)
