"""One micro-batch's loss and backward as a run computes them: under the run's autocast
(``mixed_precision=``), with the user's loss (``model_loss.py``), scaled for fp16.

Example (what the loop does per micro-batch)::

    micro = MicroStep(spec, ctx, state.scaler, state.module)
    micro.backward(micro.loss(state.model, batch))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from axon_nb.rank import runtime
from axon_nb.rank.training import model_loss
from axon_nb.spec.train_spec import TrainSpec


class MicroStep:
    """Loss and backward of one micro-batch: autocast, the user's loss, the grad scaler."""

    def __init__(
        self, spec: TrainSpec, ctx: runtime.RankContext, scaler: Any, model: nn.Module
    ) -> None:
        self.loss_fn = spec.loss
        self.rule = model_loss.LossRule(spec.loss, model)
        self.device_type = ctx.device.type
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        self.dtype = dtypes.get(spec.mixed_precision or "")
        self.scaler = scaler

    def loss(
        self, model: nn.Module, batch: Any, num_items: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's loss under autocast (``axon_nb.rank.training.model_loss``)."""
        with self.autocast():
            return self.rule.forward(model, batch, num_items)

    def backward(self, loss: torch.Tensor) -> None:
        self.scale(loss).backward()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (unchanged without fp16)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the fp16 loss scale (unchanged without fp16)."""
        return loss / self.scaler.get_scale() if self.scaler is not None else loss

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)
