"""The optimizer and loss scaler a run builds on each rank: a named ``torch.optim`` class
with its settings (fused on CUDA where it can be) or the user's callable, and fp16 scaling
that every rank agrees on. Example::

    factory = optimizer_factory(spec, torch.device("cuda", 0))   # AdamW(fused=True, ...)
    optimizer = parallel.build_optimizer(factory)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from axon_nb.parallel.grad_scaler import GradScaler
from axon_nb.parallel.parallelize import OptimizerFactory
from axon_nb.rank import runtime
from axon_nb.spec.train_spec import OPTIMIZERS, TrainSpec


def optimizer_factory(spec: TrainSpec, device: torch.device) -> OptimizerFactory:
    """The run's optimizer: a named ``torch.optim`` class with its settings, or the user's
    callable. On a GPU, Adam and AdamW take PyTorch's fused kernel unless the settings choose
    an implementation (``fused`` or ``foreach``) or the run scales fp16 losses."""
    if callable(spec.optimizer):
        return OptimizerFactory(make=spec.optimizer)
    name, kwargs = spec.optimizer
    kwargs = dict(kwargs)
    # (not with fp16: the agreed loss scaler unscales and votes on infs before the step,
    # which the fused kernels' own scaling path does not expect)
    chosen = {"fused", "foreach"} & kwargs.keys()
    if device.type == "cuda" and name in FUSED and not chosen and spec.mixed_precision != "fp16":
        kwargs["fused"] = True
    return OptimizerFactory(getattr(torch.optim, OPTIMIZERS[name]), kwargs)


FUSED = ("adam", "adamw")
"""Named optimizers that default to ``fused=True`` on CUDA ranks."""


def grad_scaler(ctx: runtime.RankContext) -> torch.amp.GradScaler:
    """fp16 loss scaling; in a process group, ranks agree on skipping a step (each may see
    only part of the gradients)."""
    if dist.is_initialized():
        return GradScaler(ctx.device.type)
    return torch.amp.GradScaler(ctx.device.type)
