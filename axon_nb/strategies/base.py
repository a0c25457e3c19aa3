"""The ``Strategy`` contract: how a model is spread over the ranks, seen from the training loop.

A strategy is a small typed config object, built in the notebook and pickled to the ranks. Its
methods run on the ranks only, so this module (and every strategy module) imports torch lazily:
the kernel never imports it.

The loop calls, in order::

    model = strategy.parallelize(model, ctx)            # once per run
    optimizer = strategy.build_optimizer(model, make)   # once per run
    every step:
        loss = strategy.forward_backward(model, microbatches, step)
        norm = strategy.clip_grad_norm(model, max_norm)  # when clipping
        optimizer.step()
    strategy.state_dict(model)                          # full, unsharded parameters

Checkpoints use ``get_state`` / ``set_state``: model and optimizer state keyed by the user's
parameter names, either full (gathered) or as this rank's shards for
``torch.distributed.checkpoint``.

Later strategies (FSDP, ZeRO, pipeline, tensor, hybrid) override these and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext


class MicroStep(Protocol):
    """What the loop hands ``forward_backward`` for one step."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Forward ``batch`` (already on the rank's device) under autocast; the mean loss."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (through the grad scaler when fp16 is on)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast context (a no-op without mixed precision)."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    """The user's ``loss(output, target)``, or None when the model returns the loss."""


class Strategy:
    """Base of all strategies; on its own it trains the model as is (one process, no wrapping).

    Subclasses are ``@dataclass(frozen=True, kw_only=True, slots=True)`` configs with ``name``
    set, and override the methods whose behaviour they change.
    """

    __slots__ = ()
    name: ClassVar[str] = "single_device"

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` if the strategy cannot run on ``world_size`` ranks (kernel side)."""

    def check_spec(self, spec: Any, world_size: int) -> None:
        """Raise ``ValueError`` if the rest of a training spec does not suit this strategy
        (kernel side; e.g. a pipeline's micro-batches must divide each rank's batch)."""

    def data_parallel(self, rank: int, world_size: int) -> tuple[int, int]:
        """``(index, size)`` of ``rank``'s data-parallel group: ranks with the same index read
        the same samples (pipeline stages and tensor-parallel peers do)."""
        return rank, world_size

    def loss_share(self, rank: int, world_size: int) -> float:
        """Weight of ``rank``'s loss in the global mean loss (0 where a rank computes none)."""
        return 1.0 / world_size

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        """Return the model as this rank trains it (wrapped, sharded or split)."""
        return model

    def build_optimizer(
        self, model: nn.Module, make: Callable[[Any], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """Build the optimizer over this rank's parameters; ``make(params)`` builds a plain one."""
        return make(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context for micro-steps whose gradients are only accumulated locally."""
        return contextlib.nullcontext()

    def forward_backward(
        self, model: nn.Module, microbatches: Sequence[Any], step: MicroStep
    ) -> torch.Tensor:
        """Forward and backward over the step's micro-batches; returns their mean loss (detached).

        Gradients are averaged over micro-batches; only the last one synchronises them.
        """
        total = None
        count = len(microbatches)
        for i, batch in enumerate(microbatches):
            sync = i == count - 1
            with contextlib.nullcontext() if sync else self.no_sync(model):
                loss = step.loss(model, batch)
                step.backward(loss / count)
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total / count

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the norm of all of the model's gradients to ``max_norm``; returns the norm."""
        import torch

        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever ``parallelize`` returned."""
        return model

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full (unsharded) model state dict, with the user's parameter names."""
        return self.unwrap(model).state_dict()

    def get_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool
    ) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` keyed by parameter name (a collective).

        ``full=True``: gathered, unsharded tensors on the CPU (only rank 0's copy is
        complete; sharded strategies leave the other ranks' empty). ``full=False``: this rank's
        shards as DTensors (or whole tensors where nothing is sharded), for
        ``torch.distributed.checkpoint``, which reshards them on load.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=full, cpu_offload=full)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        return {"model": model_state, "optimizer": optim_state}

    def set_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what ``get_state`` returned (full on every rank, or loaded shards); an
        ``"optimizer"`` of None leaves the optimizer as it is."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=not _has_dtensors(state["model"]))
        set_model_state_dict(model, state["model"], options=options)
        if state["optimizer"] is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)

    def report(self, model: nn.Module) -> dict[str, Any]:
        """Strategy-specific figures of this rank for the metrics stream (e.g. pipeline timing)."""
        return {}

    def describe(self) -> str:
        """One line for logs and results."""
        return repr(self)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (moments, step counters) with one step of zero gradients
    at learning rate 0, if it has none yet; the parameters do not change."""
    import torch

    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if local.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _has_dtensors(state: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in state.values())


@dataclass(frozen=True, slots=True)
class SingleDevice(Strategy):
    """No parallelism: the model trains as is on one rank (``train_local``'s default).

    Example::

        axon_nb.train_local(model=make_model, data=ds, strategy=SingleDevice(), steps=20)
    """

    name: ClassVar[str] = "single_device"
