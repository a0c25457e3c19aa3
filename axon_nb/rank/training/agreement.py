"""How the ranks agree: on each step's sums (``StepAgreement``, read a step late so the rank
never waits for it), and on whether setting up failed anywhere (``agreed``).

Every step the ranks sum a few numbers: the loss (for the global mean), and flags (stop, a
checkpoint written, a checkpoint due). Reading a sum right away would make each rank wait:

- on a GPU, for the device to finish the step (a host sync per step);
- on CPU ranks (gloo), for the slowest rank to reach the same point, and for gloo's worker
  threads to hand the sum over (a second lockstep per step besides DDP's gradients; it cost
  about 3 ms of a 35 ms step on two CPU ranks).

Instead the loop posts step ``s`` and reads step ``s - 1``. On a GPU the sum of ``s - 1`` was
copied to pinned host memory before step ``s``'s kernels were queued, so reading it waits only
for step ``s - 1`` while the GPU already works on step ``s``. Elsewhere the all-reduce is left
running in the background (``async_op=True``) and its work is waited for only when read,
a step later, by when it has long finished; only a pipeline's stages (``lockstep=True``) still
wait for it at once, so each of their steps starts together and the bubble each stage
measures is counted from there.

Example (what the loop does each step)::

    agreement = StepAgreement(world_size, device)
    agreement.post(torch.stack([loss * share, stop]), local=torch.stack([loss, norm]))
    # (on CPU ranks: torch.tensor([loss_value * share, stop]), local=[loss_value, norm])
    if len(agreement) > 1:
        (total, stops), (rank_loss, norm) = agreement.take()

User code run while setting up (the model, the data) may fail on some ranks only; ``agreed``
runs it on every rank and then all-reduces who failed, so no rank is left waiting in a later
collective::

    model = agreed(ctx, make_model)   # raises there, PeerFailed on the others
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from axon_nb.rank import runtime

T = TypeVar("T")


class _Posted(NamedTuple):
    """One step's values on their way: ``summed`` (reduced in place by ``work``, which is None
    on one rank or on a GPU, where the stream waits instead), ``local`` (this rank's own:
    numbers, or on a GPU their host copy) and on a GPU the copy's ``event``."""

    summed: torch.Tensor
    local: torch.Tensor | list[float]
    work: Any
    event: torch.cuda.Event | None


class StepAgreement:
    """Sums of per-step values over the ranks, taken (oldest first) after later steps start.

    ``post(summed, local=...)``: all-reduce ``summed`` (a 1-D tensor on the rank's device) in
    place and, on a GPU, copy it with ``local`` (this rank's own values, not reduced: a tensor,
    or on the CPU plain numbers) towards the host. ``take()``: the oldest posted step's values
    as Python floats, waiting only for that step. ``summed`` belongs to the agreement once
    posted: nothing else may touch it.
    """

    def __init__(self, world_size: int, device: torch.device, *, lockstep: bool = False) -> None:
        self.world_size = world_size
        self.device = device
        self.lockstep = lockstep
        """Wait for the sum when posting on CPU ranks too, so every rank starts the next step
        together: a pipeline's stages, whose measured bubble counts from a common start."""
        self._pending: deque[_Posted] = deque()

    def post(self, summed: torch.Tensor, *, local: torch.Tensor | Sequence[float] = ()) -> None:
        work = None
        if self.world_size > 1:
            work = dist.all_reduce(summed, async_op=True)
        if summed.device.type != "cuda":  # waited for when taken (no lockstep), or now
            if self.lockstep and work is not None:
                work.wait()
            numbers = local.to(summed.dtype).tolist() if isinstance(local, torch.Tensor) else local
            self._pending.append(_Posted(summed, list(numbers), work, None))
            return
        if work is not None:
            work.wait()  # on NCCL only the compute stream waits for the sum: no host wait
        own = torch.as_tensor(local, dtype=summed.dtype, device=summed.device)
        values = torch.cat([summed, own])
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append(_Posted(host[: summed.numel()], host[summed.numel() :], None, event))

    def take(self) -> tuple[list[float], list[float]]:
        """The oldest posted step's ``(summed, local)`` values."""
        summed, local, work, event = self._pending.popleft()
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return summed.tolist(), local.tolist() if isinstance(local, torch.Tensor) else local

    def wait_posted(self) -> None:
        """Wait until every posted sum is in, leaving them to be taken: none of this
        agreement's collectives is still running on the backend's threads afterwards."""
        for posted in self._pending:
            if posted.work is not None:
                posted.work.wait()

    def __len__(self) -> int:
        """Steps posted and not yet taken."""
        return len(self._pending)


class PeerFailed(RuntimeError):
    """Setting up failed on other ranks (``ranks``); they raise their own error."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"setting up failed on rank(s) {ranks}: see their error")
        self.ranks = ranks


def agreed(ctx: runtime.RankContext, fn: Callable[[], T]) -> T:
    """``fn()`` run on every rank; if it raised anywhere, it raises there and
    :class:`PeerFailed` on the others (one all-reduce).

    Example::

        dataset = agreed(ctx, lambda: resolve_dataset(spec.data, ctx.rank))
    """
    try:
        value = fn()
    except Exception:
        _failed_ranks(ctx, failed=True)
        raise
    failed = _failed_ranks(ctx, failed=False)
    if failed:
        raise PeerFailed(failed)
    return value


def _failed_ranks(ctx: runtime.RankContext, *, failed: bool) -> list[int]:
    """The ranks whose ``failed`` is true (every rank calls it)."""
    if ctx.world_size == 1:
        return [0] if failed else []
    flags = torch.zeros(ctx.world_size, device=ctx.device)
    flags[ctx.rank] = float(failed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]
