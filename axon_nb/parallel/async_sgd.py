"""AsyncSGD: stale-synchronous data parallelism with bounded staleness, decentralized.

Every rank holds the whole model (DDP) and, in its backward, starts the all-reduce of its
gradients without waiting for it (a DDP communication hook): the step is taken with the mean
gradient of ``staleness`` steps ago, whose all-reduce has had those steps to finish. A rank
waits only when that old sum is not in yet, that is when a peer is more than ``staleness``
steps behind: no rank runs more than ``staleness`` steps ahead of the slowest, and a rank
that is slow for a step (a straggler) holds nobody up while the others have steps in hand.

The order of the applied updates is fixed, so a run can be reproduced: step ``t`` applies
the mean over all ranks of the gradients of step ``t - staleness`` (an all-reduce sums the
same numbers on every rank), every rank applies the same updates in the same order, and the
parameters stay the same on every rank. The first ``staleness`` steps have no update to
apply: the optimizer skips them (the scheduler still counts them). ``staleness=0`` waits at
once: it is DDP. This is delayed-gradient SGD (bounded-staleness SSP without a parameter
server); a rank's gradient is computed on parameters that lack its last ``staleness`` updates.

    state = StaleGradients(dp_group, staleness=4)
    ddp.register_comm_hook(state, stale_hook)
    optimizer = AsyncSGDOptimizer(torch.optim.SGD(params, lr=0.1), state)
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.spec.parallel_config import AsyncSGDConfig

Sent = tuple[Any, torch.Tensor, int, int]
"""One parameter's gradient on its way: the all-reduce's work (None once loaded from a
checkpoint), the bucket's summed buffer, the offset and length of the parameter's gradient
in it."""


class StaleGradients:
    """The hook's state: the gradients of the last ``staleness`` steps on their way, by
    parameter (DDP may regroup its buckets between steps), and whether this step's gradients
    are real (``ready``: False for the first ``staleness`` steps)."""

    def __init__(self, group: Any, staleness: int) -> None:
        self.group = group
        self.staleness = staleness
        self.world = dist.get_world_size(group)
        self.sent: deque[dict[int, Sent]] = deque()
        """Each step's gradients on their way, oldest first (at most ``staleness``)."""
        self._this_step: dict[int, Sent] = {}
        self.ready = False

    def wait_sent(self) -> None:
        """Wait until every step's gradients on their way are in (they stay to be applied):
        none of their all-reduces is still running on the backend's threads afterwards."""
        for step in self.sent:
            for work, *_ in step.values():
                if work is not None:
                    work.wait()

    @classmethod
    def made_for(cls, config: AsyncSGDConfig | None, group: Any) -> StaleGradients | None:
        """The state for ``config`` over ``group``; None without staleness (plain DDP)."""
        if config is None or config.staleness == 0:
            return None
        return cls(group, config.staleness)


stale_of: weakref.WeakKeyDictionary[nn.Module, StaleGradients] = weakref.WeakKeyDictionary()
"""Each AsyncSGD model's hook state (``ddp.apply_ddp`` files it, the layout's optimizer reads
it)."""


def stale_hook(state, bucket):  # (unannotated: DDP checks a hook's annotations)
    """Start the mean of this bucket's gradients over the ranks; hand DDP the same
    parameters' mean from ``state.staleness`` steps ago (zeros while there is none).
    (``state``: :class:`StaleGradients`; ``bucket``: ``dist.GradBucket``.)"""
    buffer = bucket.buffer()
    summed = buffer.div(state.world)  # (a new tensor: the bucket's own is DDP's)
    work = dist.all_reduce(summed, group=state.group, async_op=True)
    params = bucket.parameters()
    offsets = _offsets(params)
    for p, at in zip(params, offsets, strict=True):
        state._this_step[id(p)] = (work, summed, at, p.numel())
    out = torch.zeros_like(buffer)
    due = len(state.sent) >= state.staleness
    if due:
        oldest = state.sent[0]
        for p, at in zip(params, offsets, strict=True):
            out[at : at + p.numel()] = _arrived(oldest[id(p)])
    if bucket.is_last():  # (DDP's last bucket of this backward)
        state.sent.append(state._this_step)
        state._this_step = {}
        if len(state.sent) > state.staleness:
            state.sent.popleft()
        state.ready = due
    future = torch.futures.Future()
    future.set_result(out)
    return future


def _arrived(sent: Sent) -> torch.Tensor:
    """A parameter's mean gradient on its way, once its all-reduce is done (flat, a view)."""
    work, summed, at, n = sent
    if work is not None:  # (None: loaded from a checkpoint)
        work.wait()
    return summed[at : at + n]


def _offsets(params: list[torch.Tensor]) -> list[int]:
    """Where each parameter's gradient starts in its bucket's flat buffer (in order, packed)."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    return offsets


class AsyncSGDOptimizer(torch.optim.Optimizer):
    """``optim``, skipping the steps that have no stale gradient to apply yet (the first
    ``staleness``). Its ``state_dict`` is the inner optimizer's; the gradients in flight go
    into checkpoints as its ``strategy_state`` (``strategy_state.py``)."""

    def __init__(self, optim: torch.optim.Optimizer, stale: StaleGradients) -> None:
        # (no Optimizer.__init__: param_groups and state are the inner optimizer's)
        self.optim = optim
        self.param_groups = optim.param_groups
        self.state = optim.state
        self.stale = stale
        self._params = [p for g in optim.param_groups for p in g["params"]]

    @property
    def state_kind(self) -> str:
        """``async_sgd``, with its staleness (the number of gradients kept)."""
        return f"async_sgd(staleness={self.stale.staleness})"

    def kept_tensors(self) -> list[torch.Tensor]:
        """The mean gradients in flight (for the memory figures): one buffer per bucket and
        step."""
        buffers = {id(t): t for step in self.stale.sent for _, t, _, _ in step.values()}
        return list(buffers.values())

    def strategy_state(
        self, names: dict[int, str], *, local: bool = True
    ) -> dict[str, torch.Tensor]:
        """The mean gradients in flight (``pending<i>/<name>``, oldest first; zeros in the
        slots not filled yet) and how many there are (``filled``); all the same on every rank
        (nothing ``local``)."""
        sent = self.stale.sent
        state = {"filled": torch.tensor([len(sent)])}
        for i in range(self.stale.staleness):
            for p in self._params:
                mean = _mean_in(sent[i], p) if i < len(sent) else None
                state[f"pending{i}/{names[id(p)]}"] = torch.zeros_like(p) if mean is None else mean
        return state

    def load_strategy_state(self, saved: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        """The gradients in flight from :meth:`strategy_state` (the same on every rank)."""
        self.stale.sent.clear()
        for i in range(int(saved["filled"].item())):
            step: dict[int, Sent] = {}
            for p in self._params:
                mean = saved[f"pending{i}/{names[id(p)]}"].reshape(-1).to(p.device, p.dtype)
                step[id(p)] = (None, mean, 0, mean.numel())
            self.stale.sent.append(step)

    def __repr__(self) -> str:
        return f"AsyncSGD(staleness={self.stale.staleness}, {self.optim!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        """The inner optimizer's step on the stale mean gradients, or none yet."""
        if not self.stale.ready:
            return None
        return self.optim.step(closure)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner optimizer's state; the gradients in flight start afresh (a
        checkpoint of this kind restores them after: ``load_strategy_state``)."""
        self.optim.load_state_dict(state_dict)
        self.state = self.optim.state
        self.param_groups = self.optim.param_groups  # (torch makes new group dicts)
        self.stale.sent.clear()
        self.stale._this_step = {}
        self.stale.ready = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("AsyncSGD keeps the parameter groups it was built with")


def _mean_in(step: dict[int, Sent], p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s mean gradient in ``step`` (waiting for its all-reduce), or None if not there."""
    if id(p) not in step:
        return None
    return _arrived(step[id(p)]).view_as(p).detach().clone()
