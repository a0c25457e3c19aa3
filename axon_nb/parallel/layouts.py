"""Data-parallel layouts: one class per way the data-parallel ranks hold a model.

``parallelize`` picks one from ``ParallelConfig.data_parallel`` (:func:`layout_for`), once; it
wraps every part of the model (step 5 of ``parallelize``) and then answers, for
:class:`~axon_nb.parallel.parallelize.ParallelModel`, everything that differs between layouts:

============  ======================  =====================================================
``"none"``    :class:`Layout`         the model as is
``"ddp"``     :class:`DDPLayout`      ``DistributedDataParallel`` (or post-local SGD)
``"zero1"``   :class:`ZeRO1Layout`    DDP, the optimizer state sharded
``"zero2"``   :class:`ZeRO2Layout`    gradients and optimizer state sharded
``"fsdp"``    :class:`FSDPLayout`     FSDP2 (ZeRO-3): parameters sharded too
============  ======================  =====================================================

A pipeline wraps the layout of its stages (:class:`PipelinedLayout`): stages synchronise
through their schedule and their state is gathered from every stage.

Example::

    layout = layout_for(ParallelConfig(data_parallel="ddp", ddp=DDPConfig()))
    part = layout.wrap(model, site)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from torch import nn

from axon_nb.parallel import pipeline, zero1
from axon_nb.parallel.activation_checkpoint import canonical_name, parameter_names
from axon_nb.parallel.async_sgd import AsyncSGDOptimizer, StaleGradients, stale_of
from axon_nb.parallel.ddp import apply_ddp, local_sgd_optimizer
from axon_nb.parallel.diloco import DiLoCoOptimizer
from axon_nb.parallel.fsdp import apply_fsdp
from axon_nb.parallel.grads import clip_grad_norm_
from axon_nb.parallel.optim_state import init_optimizer_state, on_cpu
from axon_nb.parallel.optimizer_factory import OptimizerFactory
from axon_nb.parallel.param_groups import GroupPlan, check_built
from axon_nb.parallel.pipeline import PipelinedModel
from axon_nb.parallel.zero2 import GradShardedModel
from axon_nb.spec.parallel_config import (
    AsyncSGDConfig,
    DDPConfig,
    DiLoCoConfig,
    FSDPConfig,
    LocalSGDConfig,
    ParallelConfig,
)
from axon_nb.spec.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel


State = dict[str, Any]
"""``{"model": ..., "optimizer": ...}``, keyed by parameter name (see ``get_state``)."""


class Parallelized(Protocol):
    """What a layout uses of the model it lays out (``parallelize.ParallelModel`` has it)."""

    model: nn.Module
    root: nn.Module
    mesh: Any
    dp_group: Any
    groups: GroupPlan

    def param_groups(self) -> list[dict[str, Any]]: ...

    def group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]: ...


@dataclass(frozen=True)
class Site:
    """Where a part is laid out: the mesh and groups of this rank, and what is kept apart."""

    dims: ParallelDims
    mesh: Any
    """The ``DeviceMesh`` over all ranks, or None without a process group."""
    dp_group: Any
    """This rank's data-parallel process group (None without a process group)."""
    device: torch.device
    groups: GroupPlan
    """The optimizer's parameter groups (ZeRO-2 buckets by them)."""
    experts: frozenset[int]
    """``id``s of expert parallelism's parameters: their gradients are reduced apart."""


@dataclass(frozen=True)
class Layout:
    """No data parallelism (``data_parallel="none"``), and what every layout does unless it
    says otherwise: the state through ``torch.distributed.checkpoint``'s state-dict helpers,
    the optimizer over the parameters this rank trains."""

    kind: ClassVar[str] = "none"
    shards: ClassVar[bool] = False
    """Parameters are sharded by ``wrap`` (meta parameters are made real after it, not
    before: each rank then reads only its shards)."""

    @classmethod
    def from_config(cls, config: ParallelConfig) -> Layout:
        """The layout with ``config``'s options for it."""
        return cls()

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        """``part`` held over the data-parallel ranks of ``site``."""
        return part

    def no_sync(self, parallel: Parallelized) -> contextlib.AbstractContextManager[None]:
        """Context for micro-steps whose gradients are only accumulated locally."""
        return contextlib.nullcontext()

    def finish_backward(self, parallel: Parallelized) -> None:
        """After a step's last backward: wait for gradient reductions still in flight."""

    def build_optimizer(
        self, parallel: Parallelized, factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        """The optimizer over this rank's trainable parameters, in the run's groups."""
        groups = parallel.param_groups()
        optimizer = factory(groups)
        if factory.cls is None:
            check_built(optimizer, groups, keep_groups=False)
        return optimizer

    def clip_grad_norm(self, parallel: Parallelized, max_norm: float) -> torch.Tensor:
        """Clip the norm of the whole model's gradients, wherever their pieces are."""
        return clip_grad_norm_(parallel.model.parameters(), max_norm)

    def full_state_dict(self, parallel: Parallelized) -> dict[str, torch.Tensor]:
        """The whole model's state dict with the user's names, on every rank."""
        return {canonical_name(k): _full_tensor(v) for k, v in parallel.root.state_dict().items()}

    def get_state(
        self,
        parallel: Parallelized,
        optimizer: torch.optim.Optimizer,
        *,
        full: bool,
        every_rank: bool,
    ) -> State:
        """See :meth:`ParallelModel.get_state`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        offload = full and not every_rank  # (offloading keeps the full copy on rank 0 only)
        options = StateDictOptions(full_state_dict=full, cpu_offload=offload)
        model_state, optim_state = get_state_dict(parallel.model, optimizer, options=options)
        if full and every_rank:
            model_state, optim_state = on_cpu(model_state), on_cpu(optim_state)
        return {"model": model_state, "optimizer": optim_state}

    def set_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, state: State
    ) -> None:
        """See :meth:`Parallelized.set_state`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sharded = any(hasattr(v, "device_mesh") for v in state["model"].values())
        options = StateDictOptions(full_state_dict=not sharded)
        set_model_state_dict(parallel.model, state["model"], options=options)
        if state["optimizer"] is not None:
            init_optimizer_state(optimizer)  # (DCP's own init steps DiLoCo's, AsyncSGD's)
            set_optimizer_state_dict(parallel.model, optimizer, state["optimizer"], options=options)


@dataclass(frozen=True)
class DDPLayout(Layout):
    """``data_parallel="ddp"``: every rank holds the whole model in DDP, which all-reduces
    gradients in buckets (``local_sgd``, ``diloco``, ``async_sgd``: see their modules)."""

    kind: ClassVar[str] = "ddp"
    ddp: DDPConfig
    local_sgd: LocalSGDConfig | None = None
    diloco: DiLoCoConfig | None = None
    async_sgd: AsyncSGDConfig | None = None

    @classmethod
    def from_config(cls, config: ParallelConfig) -> Layout:
        return cls(config.ddp or DDPConfig(), config.local_sgd, config.diloco, config.async_sgd)

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        ignored = [n for n, p in part.named_parameters() if id(p) in site.experts]
        stale = StaleGradients.made_for(self.async_sgd, site.dp_group)
        return apply_ddp(part, site.dp_group, site.device, self.ddp, self.local_sgd, ignored,
                         local_steps=self.diloco is not None, stale=stale)  # fmt: skip

    def no_sync(self, parallel: Parallelized) -> contextlib.AbstractContextManager[None]:
        return cast("DistributedDataParallel", parallel.model).no_sync()

    def build_optimizer(
        self, parallel: Parallelized, factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        optimizer = super().build_optimizer(parallel, factory)
        if self.diloco is not None:
            return DiLoCoOptimizer(optimizer, parallel.dp_group, self.diloco)
        if (stale := stale_of.get(parallel.model)) is not None:
            return AsyncSGDOptimizer(optimizer, stale)
        if self.local_sgd is None:
            return optimizer
        return local_sgd_optimizer(optimizer, parallel.dp_group, self.local_sgd)


@dataclass(frozen=True)
class _WholeParameters(Layout):
    """ZeRO-1 and ZeRO-2: parameters stay whole on every rank, the optimizer state is
    sharded; their state is always given unsharded (it loads on any number of ranks)."""

    def get_state(
        self,
        parallel: Parallelized,
        optimizer: torch.optim.Optimizer,
        *,
        full: bool,
        every_rank: bool,
    ) -> State:
        model_state = {canonical_name(k): v.detach() for k, v in parallel.root.state_dict().items()}
        if full:
            model_state = {k: v.cpu().clone() for k, v in model_state.items()}
        return {"model": model_state, "optimizer": self.optimizer_state(parallel, optimizer)}

    def set_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, state: State
    ) -> None:
        with torch.no_grad():
            own = parallel.root.state_dict(keep_vars=True)
            for name, tensor in own.items():  # into the (bucket) storage, in place
                tensor.copy_(state["model"][canonical_name(name)])
        if state["optimizer"] is not None:
            self.load_optimizer_state(parallel, optimizer, state["optimizer"])

    def optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name, on every rank (a collective)."""
        raise NotImplementedError

    def load_optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, named: dict[str, Any]
    ) -> None:
        """Load what :meth:`optimizer_state` gave (from any number of ranks)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ZeRO1Layout(_WholeParameters):
    """``data_parallel="zero1"``: DDP's gradients, the optimizer state sharded
    (``ZeroRedundancyOptimizer``, ``axon_nb.parallel.zero1``)."""

    kind: ClassVar[str] = "zero1"
    ddp: DDPConfig

    @classmethod
    def from_config(cls, config: ParallelConfig) -> Layout:
        return cls(config.ddp or DDPConfig())

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        ignored = [n for n, p in part.named_parameters() if id(p) in site.experts]
        return apply_ddp(part, site.dp_group, site.device, self.ddp, None, ignored)

    def no_sync(self, parallel: Parallelized) -> contextlib.AbstractContextManager[None]:
        return cast("DistributedDataParallel", parallel.model).no_sync()

    def build_optimizer(
        self, parallel: Parallelized, factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        return zero1.build_optimizer(parallel.param_groups(), factory, parallel.dp_group)

    def optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        names = [n for group in parallel.group_names(optimizer) for n in group]
        zero = cast("ZeroRedundancyOptimizer", optimizer)
        return zero1.full_optimizer_state(zero, names, parallel.dp_group)

    def load_optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, named: dict[str, Any]
    ) -> None:
        zero = cast("ZeroRedundancyOptimizer", optimizer)
        zero1.load_optimizer_state(zero, named, parallel.group_names(optimizer))


@dataclass(frozen=True)
class ZeRO2Layout(_WholeParameters):
    """``data_parallel="zero2"``: gradients reduce-scattered in buckets during backward, each
    rank keeping its shard of them and of the optimizer state (``axon_nb.parallel.zero2``)."""

    kind: ClassVar[str] = "zero2"
    bucket_cap_mb: float = 25.0

    @classmethod
    def from_config(cls, config: ParallelConfig) -> Layout:
        return cls(config.bucket_cap_mb)

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        by_group = [g["params"] for g in site.groups.groups(part.named_parameters())]
        return GradShardedModel(
            part, site.dp_group, bucket_cap_mb=self.bucket_cap_mb, param_groups=by_group
        )

    def no_sync(self, parallel: Parallelized) -> contextlib.AbstractContextManager[None]:
        return _sharded(parallel).no_sync()

    def finish_backward(self, parallel: Parallelized) -> None:
        _sharded(parallel).finish_backward()

    def build_optimizer(
        self, parallel: Parallelized, factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        return _sharded(parallel).build_optimizer(factory, parallel.groups.options)

    def clip_grad_norm(self, parallel: Parallelized, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(_sharded(parallel).shards(), max_norm, group=parallel.dp_group)

    def optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        names = parameter_names(parallel.root)
        return _sharded(parallel).full_optimizer_state(optimizer, names)

    def load_optimizer_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, named: dict[str, Any]
    ) -> None:
        names = parameter_names(parallel.root)
        _sharded(parallel).load_full_optimizer_state(optimizer, named, names)


@dataclass(frozen=True)
class FSDPLayout(Layout):
    """``data_parallel="fsdp"`` (ZeRO-3): parameters, gradients and optimizer state sharded
    by FSDP2, hybrid-sharded (shard within ``dp_shard``, replicate across ``dp_replicate``)
    on a 2-D mesh."""

    kind: ClassVar[str] = "fsdp"
    shards: ClassVar[bool] = True
    fsdp: FSDPConfig
    diloco: DiLoCoConfig | None = None  # (DiLoCo's workers: each a dp_shard group of ranks)

    @classmethod
    def from_config(cls, config: ParallelConfig) -> Layout:
        return cls(config.fsdp or FSDPConfig(), config.diloco)

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        dims, mesh = site.dims, site.mesh
        replicated = dims.dp_replicate > 1 and self.diloco is None  # (DiLoCo: no grads across)
        fsdp_mesh = mesh["dp_replicate", "dp_shard"] if replicated else mesh["dp_shard"]
        if dims.ep > 1:  # the experts' ranks read different data: all of dp shards the rest
            fsdp_mesh = dims.dp_mesh(site.device.type)
        ignored = {p for p in part.parameters() if id(p) in site.experts}
        return apply_fsdp(part, fsdp_mesh, self.fsdp, ignored)

    def no_sync(self, parallel: Parallelized) -> contextlib.AbstractContextManager[None]:
        return _without_gradient_sync(cast("FSDPModule", parallel.model))

    def build_optimizer(self, parallel: Parallelized, factory: OptimizerFactory
                        ) -> torch.optim.Optimizer:  # fmt: skip
        optimizer = super().build_optimizer(parallel, factory)
        if self.diloco is None:
            return optimizer
        return DiLoCoOptimizer(optimizer, parallel.mesh["dp_replicate"].get_group(), self.diloco)


@dataclass(frozen=True)
class PipelinedLayout(Layout):
    """Pipeline stages, each held by the ``stages`` layout: they synchronise through their
    schedule, and their state is gathered from (and loaded into) every stage, unsharded."""

    kind: ClassVar[str] = "pipeline"
    stages: Layout

    def wrap(self, part: nn.Module, site: Site) -> nn.Module:
        return self.stages.wrap(part, site)

    def build_optimizer(
        self, parallel: Parallelized, factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        return self.stages.build_optimizer(parallel, factory)

    def clip_grad_norm(self, parallel: Parallelized, max_norm: float) -> torch.Tensor:
        group = _pipelined(parallel).group
        return clip_grad_norm_(parallel.model.parameters(), max_norm, group=group)

    def full_state_dict(self, parallel: Parallelized) -> dict[str, torch.Tensor]:
        return pipeline.gather_state(_pipelined(parallel))

    def get_state(
        self,
        parallel: Parallelized,
        optimizer: torch.optim.Optimizer,
        *,
        full: bool,
        every_rank: bool,
    ) -> State:
        model = _pipelined(parallel)
        return {
            "model": pipeline.gather_state(model),
            "optimizer": pipeline.gather_optimizer_state(model, optimizer),
        }

    def set_state(
        self, parallel: Parallelized, optimizer: torch.optim.Optimizer, state: State
    ) -> None:
        pipeline.load_full_state(_pipelined(parallel), optimizer, state)


LAYOUTS: dict[str, type[Layout]] = {
    layout.kind: layout for layout in (Layout, DDPLayout, ZeRO1Layout, ZeRO2Layout, FSDPLayout)
}
"""Layouts by ``ParallelConfig.data_parallel``."""


def layout_for(config: ParallelConfig) -> Layout:
    """The data-parallel layout ``config`` asks for (of each stage, in a pipeline).

    Example::

        layout_for(ZeRO(stage=2).config()).kind   # "zero2"
    """
    return LAYOUTS[config.data_parallel].from_config(config)


def _sharded(parallel: Parallelized) -> GradShardedModel:
    return cast(GradShardedModel, parallel.model)


def _pipelined(parallel: Parallelized) -> PipelinedModel:
    return cast(PipelinedModel, parallel.model)


@contextlib.contextmanager
def _without_gradient_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _full_tensor(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value
