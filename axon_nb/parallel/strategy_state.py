"""State a strategy keeps besides the model's and the optimizer's own, so that a checkpoint
resumes it exactly: DiLoCo's global parameters, outer momentum and step count, AsyncSGD's
gradients in flight. The optimizers that keep some (``DiLoCoOptimizer``,
``AsyncSGDOptimizer``) give it as a flat dict of tensors keyed by parameter name (the same
on every rank, so a sharded checkpoint stores it once and it loads on any number of ranks);
``rank/checkpoint/checkpoint_io.py`` writes it under ``"strategy"``. What differs between
ranks is keyed by rank (``local<rank>/<name>``: DiLoCo's parameters between outer steps,
each rank's own): a rank restores its own on the same number of ranks, and on another
number such keys are left out (``local=False``) and the strategy goes on from what is common.

    keeper = kept_by(optimizer)
    if keeper is not None:
        saved = keeper.strategy_state(names)    # {"steps": tensor([3]), "global/w": ...}
        keeper.load_strategy_state(saved, names)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class KeepsState(Protocol):
    """An optimizer with state of its strategy's own (``names``: parameter id -> name)."""

    @property
    def state_kind(self) -> str:
        """What the state is (a checkpoint's state loads only into a run of the same kind)."""
        ...

    def strategy_state(
        self, names: dict[int, str], *, local: bool = True
    ) -> dict[str, torch.Tensor]:
        """The state, tensors by key; with ``local``, this rank's own parts too."""
        ...

    def load_strategy_state(self, saved: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        """Load what :meth:`strategy_state` gave (after the model and the optimizer)."""
        ...


def local_key(rank: int, name: str) -> str:
    """The key of rank ``rank``'s own part of parameter ``name``'s state."""
    return f"local{rank}/{name}"


def is_local(key: str) -> bool:
    """Whether ``key`` names one rank's own part (see :func:`local_key`)."""
    return key.startswith("local")


def kept_by(optimizer: Any) -> KeepsState | None:
    """``optimizer`` when it keeps state of its strategy's own, else None."""
    return optimizer if isinstance(optimizer, KeepsState) else None
