"""The loop's one all-reduce per step, read a step late so the host never waits for the device.

Every step the ranks sum a few numbers: the loss (for the global mean), and flags (stop, a
checkpoint written, a checkpoint due). Reading a sum right away would make the host wait for
the GPU to finish the step (a host sync per step). Instead the loop posts step ``s`` and
reads step ``s - 1``: on a GPU the sum of ``s - 1`` was copied to pinned host memory before
step ``s``'s kernels were queued, so reading it waits only for step ``s - 1``, while the GPU
already works on step ``s``.

Example (what the loop does each step)::

    agreement = StepAgreement(world_size, device)
    agreement.post(torch.stack([loss * share, stop]), local=torch.stack([loss, norm]))
    if len(agreement) > 1:
        (total, stops), (rank_loss, norm) = agreement.take()
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


class StepAgreement:
    """Sums of per-step values over the ranks, taken (oldest first) after later steps start.

    ``post(summed, local=...)``: all-reduce ``summed`` (a 1-D tensor on the rank's device)
    and copy it, with ``local`` (this rank's own values, not reduced), towards the host.
    ``take()``: the oldest posted step's values as Python floats, waiting only for that step.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._pending: deque[tuple[torch.Tensor, int, torch.cuda.Event | None]] = deque()

    def post(self, summed: torch.Tensor, *, local: torch.Tensor | None = None) -> None:
        if self.world_size > 1:
            # On NCCL, wait() only makes the compute stream wait for the sum: no host wait.
            dist.all_reduce(summed, async_op=True).wait()
        values = summed if local is None else torch.cat([summed, local.to(summed.dtype)])
        event = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._pending.append((values, summed.numel(), event))

    def take(self) -> tuple[list[float], list[float]]:
        """The oldest posted step's ``(summed, local)`` values."""
        values, n, event = self._pending.popleft()
        if event is not None:
            event.synchronize()
        numbers = values.tolist()
        return numbers[:n], numbers[n:]

    def __len__(self) -> int:
        """Steps posted and not yet taken."""
        return len(self._pending)
