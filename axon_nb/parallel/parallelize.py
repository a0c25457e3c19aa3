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
of a layout (no_sync, the optimizer, clipping, full and sharded state), in one place.

Example::

    strategy = FSDP()
    dims = strategy.dims(world_size=4)
    parallel = parallelize(model, dims, strategy.config(), torch.device("cpu"))
    optimizer = parallel.build_optimizer(OptimizerFactory(...))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.parallel import pipeline, zero1
from axon_nb.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    canonical_name,
    parameter_names,
)
from axon_nb.parallel.compile import apply_compile
from axon_nb.parallel.ddp import apply_ddp, local_sgd_optimizer
from axon_nb.parallel.dtensor_cache import forget_cached_meshes
from axon_nb.parallel.expert import apply_ep, reduce_expert_grads, take_routed_tokens
from axon_nb.parallel.fsdp import apply_fsdp
from axon_nb.parallel.grads import clip_grad_norm_
from axon_nb.parallel.group_ledger import recording
from axon_nb.parallel.param_groups import GroupPlan, check_built, check_settings, plan_groups
from axon_nb.parallel.pipeline import PipelinedModel
from axon_nb.parallel.tensor import apply_tp
from axon_nb.parallel.zero2 import GradShardedModel
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
    mesh = dims.mesh(device.type) if dist.is_initialized() else None
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
    parts = [
        _data_parallel(part, dims, config, mesh, dp_group, device, groups, materialize, experts)
        for part in parts
    ]
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
    return ParallelModel(
        model=trained,
        root=model,
        dims=dims,
        config=config,
        mesh=mesh,
        dp_group=dp_group,
        groups=groups,
        experts=experts,
        edp_group=dims.edp_mesh(device.type).get_group() if experts else None,
    )


def _data_parallel(
    part: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    mesh: Any,
    dp_group: Any,
    device: torch.device,
    groups: GroupPlan,
    materialize: Callable[[nn.Module], None] | None = None,
    experts: list[nn.Parameter] | None = None,
) -> nn.Module:
    """Step 5: ``part`` replicated or sharded over the data-parallel ranks (and its meta
    parameters made real by ``materialize``: before replication, after sharding), but for
    its ``experts`` parameters."""
    sharded = config.data_parallel == "fsdp"
    if materialize is not None and not sharded:
        materialize(part)
    part = _replicate_or_shard(part, dims, config, mesh, dp_group, device, groups, experts or [])
    if materialize is not None and sharded:
        materialize(part)
    return part


def _replicate_or_shard(
    part: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    mesh: Any,
    dp_group: Any,
    device: torch.device,
    groups: GroupPlan,
    experts: list[nn.Parameter],
) -> nn.Module:
    kind = config.data_parallel
    mine = {id(p) for p in experts}
    if kind in ("ddp", "zero1"):
        assert config.ddp is not None
        local_sgd = config.local_sgd if kind == "ddp" else None
        ignored = [n for n, p in part.named_parameters() if id(p) in mine]
        return apply_ddp(part, dp_group, device, config.ddp, local_sgd, ignored)
    if kind == "zero2":
        by_group = [g["params"] for g in groups.groups(part.named_parameters())]
        return GradShardedModel(
            part, dp_group, bucket_cap_mb=config.bucket_cap_mb, param_groups=by_group
        )
    if kind == "fsdp":
        assert config.fsdp is not None
        # Hybrid sharding: shard within dp_shard, replicate across dp_replicate (2-D mesh).
        replicated = dims.dp_replicate > 1
        fsdp_mesh = mesh["dp_replicate", "dp_shard"] if replicated else mesh["dp_shard"]
        if dims.ep > 1:  # the experts' ranks read different data: all of dp shards the rest
            fsdp_mesh = dims.dp_mesh(device.type)
        ignored = {p for p in part.parameters() if id(p) in mine}
        return apply_fsdp(part, fsdp_mesh, config.fsdp, ignored)
    return part


@dataclass(eq=False)
class ParallelModel:
    """A model as ``parallelize`` laid it out on this rank, and what training asks of it."""

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
        return self.config.data_parallel

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for micro-steps whose gradients are only accumulated locally."""
        if self.pipeline is not None:
            return contextlib.nullcontext()  # stages synchronise through their schedule
        if self.data_parallel in ("ddp", "zero1", "zero2"):
            return self.model.no_sync()  # type: ignore[operator,return-value]
        if self.data_parallel == "fsdp":
            return _without_gradient_sync(self.model)
        return contextlib.nullcontext()

    def finish_backward(self) -> None:
        """After a step's last backward: wait for gradient reductions still in flight."""
        if isinstance(self.model, GradShardedModel):
            self.model.finish_backward()

    def reduce_expert_grads(self) -> None:
        """After a step's backward (every layout, pipelines too): the experts' gradients
        averaged like the other parameters' (``axon_nb.parallel.expert``)."""
        if self.experts:
            reduce_expert_grads(self.experts, self.edp_group, self.dims.dp)

    def build_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this rank's trainable parameters in the run's groups (sharded
        for ZeRO-1 and ZeRO-2), by name or by the user's callable, which must keep them."""
        if isinstance(self.model, GradShardedModel):
            optimizer = self.model.build_optimizer(factory, self.groups.options)
        elif self.data_parallel == "zero1":
            optimizer = zero1.build_optimizer(self._param_groups(), factory, self.dp_group)
        else:
            groups = self._param_groups()
            optimizer = factory(groups)
            if factory.cls is None:
                check_built(optimizer, groups, keep_groups=False)
            if self.config.local_sgd is not None and self.data_parallel == "ddp":
                optimizer = local_sgd_optimizer(optimizer, self.dp_group, self.config.local_sgd)
        check_settings(self.groups, optimizer)
        return optimizer

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the norm of the whole model's gradients, wherever their pieces are."""
        if isinstance(self.model, GradShardedModel):
            return clip_grad_norm_(self.model.shards(), max_norm, group=self.dp_group)
        group = self.pipeline.group if self.pipeline is not None else None
        return clip_grad_norm_(self.model.parameters(), max_norm, group=group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with the user's names, on every rank (a collective)."""
        if self.pipeline is not None:
            return pipeline.gather_state(self.pipeline)
        return {
            canonical_name(k): v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in self.root.state_dict().items()
        }

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
        if self.pipeline is not None:
            return {
                "model": pipeline.gather_state(self.pipeline),
                "optimizer": pipeline.gather_optimizer_state(self.pipeline, optimizer),
            }
        if self.data_parallel in ("zero1", "zero2"):
            model_state = {canonical_name(k): v.detach() for k, v in self.root.state_dict().items()}
            if full:
                model_state = {k: v.cpu().clone() for k, v in model_state.items()}
            return {"model": model_state, "optimizer": self._zero_optimizer_state(optimizer)}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        offload = full and not every_rank  # (offloading keeps the full copy on rank 0 only)
        options = StateDictOptions(full_state_dict=full, cpu_offload=offload)
        model_state, optim_state = get_state_dict(self.model, optimizer, options=options)
        if full and every_rank:
            model_state, optim_state = _on_cpu(model_state), _on_cpu(optim_state)
        return {"model": model_state, "optimizer": optim_state}

    def set_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`get_state` returned (full, or loaded shards); an ``"optimizer"`` of
        None leaves the optimizer as it is."""
        if self.pipeline is not None:
            pipeline.load_full_state(self.pipeline, optimizer, state)
            return
        if self.data_parallel in ("zero1", "zero2"):
            with torch.no_grad():
                own = self.root.state_dict(keep_vars=True)
                for name, tensor in own.items():  # into the (bucket) storage, in place
                    tensor.copy_(state["model"][canonical_name(name)])
            if state["optimizer"] is not None:
                self._load_zero_optimizer_state(optimizer, state["optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sharded = any(hasattr(v, "device_mesh") for v in state["model"].values())
        options = StateDictOptions(full_state_dict=not sharded)
        set_model_state_dict(self.model, state["model"], options=options)
        if state["optimizer"] is not None:
            set_optimizer_state_dict(self.model, optimizer, state["optimizer"], options=options)

    def report(self) -> dict[str, Any]:
        """Layout-specific figures of this step for the metrics stream: pipeline timing, and
        with expert parallelism ``expert_tokens``, the tokens this rank routed to each expert."""
        figures = dict(self.pipeline.last_step) if self.pipeline is not None else {}
        if self.experts:
            figures["expert_tokens"] = take_routed_tokens(self.root)
        return figures

    def _param_groups(self) -> list[dict[str, Any]]:
        """The run's parameter groups over the parameters this rank trains."""
        names = parameter_names(self.root)
        return self.groups.groups((names[id(p)], p) for p in self.model.parameters())

    def _group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        names = parameter_names(self.root)
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def _zero_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(self.model, GradShardedModel):
            return self.model.full_optimizer_state(optimizer, parameter_names(self.root))
        names = [n for group in self._group_names(optimizer) for n in group]
        return zero1.full_optimizer_state(optimizer, names, self.dp_group)  # type: ignore[arg-type]

    def _load_zero_optimizer_state(
        self, optimizer: torch.optim.Optimizer, named: dict[str, Any]
    ) -> None:
        if isinstance(self.model, GradShardedModel):
            self.model.load_full_optimizer_state(optimizer, named, parameter_names(self.root))
            return
        zero1.load_optimizer_state(optimizer, named, self._group_names(optimizer))  # type: ignore[arg-type]


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


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _on_cpu(state: Any) -> Any:
    """``state`` (nested dicts and lists of tensors) with every tensor on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_on_cpu(v) for v in state]
    return state
