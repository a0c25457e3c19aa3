"""``parallelize``: every technique applied to a model in one fixed order, on every rank.

The order, and why::

    1. tensor parallel        replaces Linear weights with DTensors; everything after wraps them
       expert parallel        shards stacked expert weights over ``ep`` (DTensors too), makes
                              their modules dispatch tokens by all-to-all; step 5 leaves them be
    2. activation checkpoint  wraps blocks, so stages hold and FSDP shards the wrapped blocks
    3. compile (optional)     torch.compile each block in place, before it is sharded
    4. pipeline split         keeps this rank's stages, frees the other layers
    5. data parallel          FSDP | DDP | ZeRO-1 | ZeRO-2 over the data-parallel axes, per stage

A model built with its parameters on the meta device (``axon_nb.pretrained``) gets its
weights in step 5, part by part (``materialize``): after FSDP shards a part, so each rank
reads only its shards; before DDP or ZeRO wrap one, since they broadcast and bucket real
tensors.

The result, :class:`ParallelModel`, answers everything the training loop and checkpoints ask
of a layout (no_sync, the optimizer, clipping, full and sharded state): its data-parallel
:class:`~axon_nb.parallel.layouts.Layout`, chosen once here, holds what differs between
DDP, ZeRO-1, ZeRO-2, FSDP and none (and a pipeline's layout wraps its stages').

Example::

    strategy = FSDP()
    dims = strategy.dims(world_size=4)
    parallel = parallelize(model, dims, strategy.config(), torch.device("cpu"))
    optimizer = parallel.build_optimizer(OptimizerFactory(...))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.parallel import pipeline
from axon_nb.parallel.activation_checkpoint import apply_activation_checkpointing, parameter_names
from axon_nb.parallel.compile import apply_compile
from axon_nb.parallel.dtensor_cache import forget_cached_meshes
from axon_nb.parallel.expert import apply_ep, reduce_expert_grads, take_routed_tokens
from axon_nb.parallel.group_ledger import recording
from axon_nb.parallel.layouts import Layout, PipelinedLayout, Site, layout_for
from axon_nb.parallel.optimizer_factory import OptimizerFactory
from axon_nb.parallel.param_groups import GroupPlan, check_settings, plan_groups
from axon_nb.parallel.pipeline import PipelinedModel
from axon_nb.parallel.tensor import apply_tp
from axon_nb.spec.parallel_config import (
    ExpertConfig,
    ParallelConfig,
    PipelineConfig,
    TensorConfig,
)
from axon_nb.spec.parallel_dims import ParallelDims


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    device: torch.device,
    *,
    compile: bool = False,
    groups: GroupPlan | None = None,
    materialize: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """Apply ``config`` to ``model`` (already on ``device``) over the mesh of ``dims``;
    ``compile``: ``torch.compile`` its blocks first (``axon_nb.parallel.compile``);
    ``groups``: the optimizer's parameter groups (default: every trainable parameter in
    one), which ZeRO-2 buckets by; ``materialize``: for a model whose parameters are on the
    meta device, ``part -> None`` makes a part's parameters real and fills them
    (``axon_nb.rank.training.meta_init.loader``)."""
    with recording(dims):  # (its groups are destroyed once no kept run holds ``dims``)
        return _parallelize(model, dims, config, device, compile, groups, materialize)


def _parallelize(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    device: torch.device,
    compile: bool,
    groups: GroupPlan | None,
    materialize: Callable[[nn.Module], None] | None,
) -> ParallelModel:
    groups = groups if groups is not None else plan_groups(model)
    forget_cached_meshes()  # (DTensor's caches would hand this layout an earlier one's mesh)
    # (None without a process group: every degree is 1 then)
    mesh: Any = dims.mesh(device.type) if dist.is_initialized() else None
    dp_group = dims.dp_mesh(device.type).get_group() if mesh is not None else None
    coords = dims.coords(dist.get_rank() if dist.is_initialized() else 0)
    piped = dims.pp > 1
    split = config.pipeline.split if config.pipeline is not None else None
    if piped:
        bounds, mine = pipeline.plan_stages(
            model, coords["pp"], dims.pp, config.pipeline or PipelineConfig()
        )
    if dims.tp > 1:
        owned = pipeline.owned_module_names(model, bounds, mine, split) if piped else None
        apply_tp(model, mesh["tp"], config.tensor or TensorConfig(), owned)
    experts: list[nn.Parameter] = []
    if dims.ep > 1:
        plan = (config.expert or ExpertConfig()).plan
        experts = [p for m in apply_ep(model, mesh["ep"], plan) for p in m.parameters()]
    if config.activation_checkpointing:
        apply_activation_checkpointing(model, config.activation_checkpointing)
    if compile:
        apply_compile(model)
    # (the layers are read again: checkpointing and compiling may have wrapped them)
    parts = pipeline.cut_stages(model, bounds, mine, split) if piped else [model]
    layout = layout_for(config)
    site = Site(dims, mesh, dp_group, device, groups, frozenset(id(p) for p in experts))
    parts = [_data_parallel(part, layout, site, materialize) for part in parts]
    if experts:  # (a pipeline keeps this rank's stages: its experts are those in them)
        ids = {id(p) for p in experts}
        experts = [p for part in parts for p in part.parameters() if id(p) in ids]
    if piped:
        trained: nn.Module = PipelinedModel(
            model,
            parts,
            mine,
            num_stages=len(bounds) - 1,
            config=config.pipeline or PipelineConfig(),
            device=device,
            group=mesh["pp"].get_group(),
        )
    else:
        trained = parts[0]
    # (a pipeline's stages synchronise through its schedule; their state is gathered apart)
    layout = PipelinedLayout(layout) if piped else layout
    return ParallelModel(
        model=trained,
        root=model,
        dims=dims,
        config=config,
        mesh=mesh,
        dp_group=dp_group,
        groups=groups,
        layout=layout,
        experts=experts,
        edp_group=dims.edp_mesh(device.type).get_group() if experts else None,
    )


def _data_parallel(
    part: nn.Module,
    layout: Layout,
    site: Site,
    materialize: Callable[[nn.Module], None] | None,
) -> nn.Module:
    """Step 5: ``part`` replicated or sharded over the data-parallel ranks (and its meta
    parameters made real by ``materialize``: before replication, after sharding), but for
    the experts' parameters."""
    if materialize is not None and not layout.shards:
        materialize(part)
    part = layout.wrap(part, site)
    if materialize is not None and layout.shards:
        materialize(part)
    return part


@dataclass(eq=False)
class ParallelModel:
    """A model as ``parallelize`` laid it out on this rank, and what training asks of it
    (answered by its :class:`~axon_nb.parallel.layouts.Layout`)."""

    model: nn.Module
    """What the loop trains: the user's module, DDP, FSDP-sharded, ZeRO-2 or pipelined."""
    root: nn.Module
    """The user's module (in a pipeline, other ranks' layers are on the meta device)."""
    dims: ParallelDims
    config: ParallelConfig
    mesh: Any
    """The ``DeviceMesh`` over all ranks, or None without a process group."""
    dp_group: Any
    """The process group of this rank's data-parallel ranks (None without a process group)."""
    groups: GroupPlan
    """The optimizer's parameter groups, by parameter name (trainable parameters only)."""
    layout: Layout = dataclasses.field(default_factory=Layout)
    """How the data-parallel ranks hold the model (a pipeline's: how they hold its stages)."""
    experts: list[nn.Parameter] = dataclasses.field(default_factory=list)
    """Expert parallelism's sharded expert weights (their gradients are reduced apart)."""
    edp_group: Any = None
    """With experts: the group of the ranks that hold the same experts."""

    @property
    def pipeline(self) -> PipelinedModel | None:
        """The pipelined model when ``pp > 1``."""
        return self.model if isinstance(self.model, PipelinedModel) else None

    @property
    def data_parallel(self) -> str:
        """``ParallelConfig.data_parallel``: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"zero1"``
        or ``"zero2"``."""
        return self.config.data_parallel

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for micro-steps whose gradients are only accumulated locally."""
        return self.layout.no_sync(self)

    def finish_backward(self) -> None:
        """After a step's last backward: wait for gradient reductions still in flight."""
        self.layout.finish_backward(self)

    def reduce_expert_grads(self) -> None:
        """After a step's backward (every layout, pipelines too): the experts' gradients
        averaged like the other parameters' (``axon_nb.parallel.expert``)."""
        if self.experts:
            reduce_expert_grads(self.experts, self.edp_group, self.dims.dp)

    def build_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this rank's trainable parameters in the run's groups (sharded
        for ZeRO-1 and ZeRO-2), by name or by the user's callable, which must keep them."""
        optimizer = self.layout.build_optimizer(self, factory)
        check_settings(self.groups, optimizer)
        return optimizer

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the norm of the whole model's gradients, wherever their pieces are."""
        return self.layout.clip_grad_norm(self, max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with the user's names, on every rank (a collective)."""
        return self.layout.full_state_dict(self)

    def get_state(
        self, optimizer: torch.optim.Optimizer, *, full: bool, every_rank: bool = False
    ) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` keyed by parameter name (a collective).

        ``full=True``: gathered, unsharded tensors on the CPU (with FSDP only rank 0's copy is
        complete). ``full=False``: this rank's shards as DTensors (or whole tensors where
        nothing is sharded), for ``torch.distributed.checkpoint``, which reshards on load.
        ZeRO-1/2 and pipelines always give the unsharded layout, so their checkpoints load on
        any number of ranks and any cut. ``every_rank=True`` (with ``full``): every rank gets
        the complete copy, on the CPU (a layout change in memory loads it on every rank).
        """
        return self.layout.get_state(self, optimizer, full=full, every_rank=every_rank)

    def set_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`get_state` returned (full, or loaded shards); an ``"optimizer"`` of
        None leaves the optimizer as it is."""
        self.layout.set_state(self, optimizer, state)

    def report(self) -> dict[str, Any]:
        """Layout-specific figures of this step for the metrics stream: pipeline timing, and
        with expert parallelism ``expert_tokens``, the tokens this rank routed to each expert."""
        figures: dict[str, Any] = {}
        if self.pipeline is not None:
            figures.update(self.pipeline.last_step)
        if self.experts:
            figures["expert_tokens"] = take_routed_tokens(self.root)
        return figures

    def param_groups(self) -> list[dict[str, Any]]:
        """The run's parameter groups over the parameters this rank trains."""
        names = parameter_names(self.root)
        return self.groups.groups((names[id(p)], p) for p in self.model.parameters())

    def group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        """The names of the parameters of each of ``optimizer``'s groups."""
        names = parameter_names(self.root)
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
