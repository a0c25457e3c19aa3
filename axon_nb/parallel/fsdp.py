"""Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from axon_nb.spec.parallel_config import FSDPConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def wrap_targets(
    model: nn.Module, classes: Sequence[str] | None, min_params: int | None
) -> list[nn.Module]:
    """Submodules that become their own FSDP unit (sharded and gathered on their own).

    By class name when ``classes`` is given, else by size when ``min_params`` is, else the
    entries of every ``nn.ModuleList`` (a transformer's blocks).
    """
    if classes:
        found = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
        present = {type(m).__name__ for m in found}
        missing = [c for c in classes if c not in present]
        if missing:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"auto_wrap class {', '.join(missing)} is not in the model; its module classes "
                f"are: {', '.join(names)}"
            )
        return found
    if min_params:
        return [
            m for m in model.modules()
            if m is not model and not list(m.children())
            and sum(p.numel() for p in m.parameters()) >= min_params
        ]  # fmt: skip
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    config: FSDPConfig,
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``model``'s units (inner first, see :func:`wrap_targets`) and then ``model`` over
    ``mesh`` (1-D: FSDP, 2-D (replicate, shard): hybrid sharding); ``ignored`` parameters stay
    as they are (expert parallelism's experts, sharded on their own axis).

    A pipeline stage (an ``nn.Sequential`` of layers) with no unit inside is sharded layer by
    layer. ``cpu_offload`` moves shards to the CPU between uses; on CPU ranks they are there
    already, so it changes nothing (and the same notebook runs on both).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    units = wrap_targets(model, config.auto_wrap, config.min_params)
    if not units and isinstance(model, nn.Sequential):
        units = [layer for layer in model if any(True for _ in layer.parameters())]
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[config.param_dtype] if config.param_dtype else None,
        reduce_dtype=DTYPES[config.reduce_dtype] if config.reduce_dtype else None,
    )
    options: dict[str, Any] = dict(
        mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward
    )
    if config.cpu_offload and mesh.device_type != "cpu":
        options["offload_policy"] = CPUOffloadPolicy()
    if ignored:
        options["ignored_params"] = ignored
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model
