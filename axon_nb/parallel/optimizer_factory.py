"""``OptimizerFactory``: how a run's optimizer is built over its parameter groups (a named
optimizer's class and settings, or a user's callable); every layout builds it through one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OptimizerFactory:
    """Builds a run's optimizer over parameter groups; ``cls`` and ``kwargs`` are known for
    named optimizers, None and empty for a user's callable (``make``), which gets a plain
    list of parameters when there is one group with no settings of its own, else the groups.

    Example::

        OptimizerFactory(torch.optim.AdamW, {"lr": 1e-3})([{"params": list(model.parameters())}])
    """

    def __init__(
        self,
        cls: type[torch.optim.Optimizer] | None = None,
        kwargs: dict[str, Any] | None = None,
        make: Callable[[Any], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs or {})
        self._make = make

    def __call__(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if self._make is not None:
            plain = len(groups) == 1 and set(groups[0]) == {"params"} and groups[0]["params"]
            return self._make(list(groups[0]["params"]) if plain else groups)
        assert self.cls is not None
        return self.cls(groups, **self.kwargs)
