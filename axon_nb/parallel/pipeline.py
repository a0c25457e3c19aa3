"""Pipeline parallelism on ``torch.distributed.pipelining``: cutting a model into stages,
building a stage's schedule, and timing it.

A model is cut along its layers: the children of an ``nn.Sequential``, or what a model's
``pipeline_layers()`` returns (``axon_nb.models.GPT``: embedding, each block, head). Stage s
holds layers ``starts[s] .. starts[s+1]``. With ``v`` virtual stages per rank (interleaved
schedules), pipeline rank r holds stages ``r, r + pp, r + 2pp, ...``. A rank keeps only its
stages' parameters; the rest of the model is moved to the meta device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The layers a pipeline can cut ``model`` into, in forward order."""
    if isinstance(model, nn.Sequential):
        return list(model)
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    raise TypeError(
        f"Pipeline cuts an nn.Sequential, or a model with a pipeline_layers() method returning "
        f"its layers in forward order (axon_nb.models.GPT has one); got {type(model).__name__}"
    )


def balanced_starts(sizes: Sequence[int], num_stages: int) -> list[int]:
    """First layer of each stage: contiguous, non-empty stages whose largest parameter count
    is as small as possible (layers without parameters count as 1)."""
    n = len(sizes)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} layers; the model has "
            f"{n}. Use at most {n} stages (num_stages x virtual_stages)"
        )
    weights = [max(1, s) for s in sizes]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # cost[k][i]: the smallest possible largest stage when layers [0, i) form k stages.
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(cost[k - 1][j], prefix[i] - prefix[j])
                if value < cost[k][i]:
                    cost[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def check_starts(starts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate user split points (first layer of every stage after the first)."""
    full = [0, *starts]
    if (
        len(full) != num_stages
        or any(b <= a for a, b in itertools.pairwise(full))
        or (full[-1] >= num_layers)
    ):
        raise ValueError(
            f"split_points must be {num_stages - 1} increasing layer indices between 1 and "
            f"{num_layers - 1} (the first layer of each stage after the first), got "
            f"{tuple(starts)}"
        )
    return full


class PipelinedModel(nn.Module):
    """This rank's stages of a model, with their schedule; ``root`` is the whole model (only
    this rank's stages hold real parameters).

    ``parts`` holds the stage modules, so ``parameters()`` are exactly this rank's.
    """

    def __init__(
        self,
        root: nn.Module,
        parts: list[nn.Module],
        stage_indices: list[int],
        num_stages: int,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        object.__setattr__(self, "root", root)  # not a submodule: its other stages are meta
        self.stage_indices = stage_indices
        self.num_stages = num_stages
        self.has_first = 0 in stage_indices
        self.has_last = num_stages - 1 in stage_indices
        self.schedule: Any = None
        self.pp_group: Any = None
        self.loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self.loss_scale = 1.0
        self.forward_s = 0.0
        self.backward_s = 0.0

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The user's loss of one micro-batch, scaled so that gradients sum to the step mean."""
        assert self.loss_fn is not None
        return self.loss_fn(output, target).float() * self.loss_scale

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipelined model runs through its schedule; train it with cluster.train, or "
            "evaluate the full model gathered with strategy.state_dict"
        )


def apply_pipeline(
    model: nn.Module,
    *,
    pp_index: int,
    pp_size: int,
    virtual_stages: int,
    split_points: Sequence[int] | None,
    schedule: str,
    microbatches: int,
    device: torch.device,
    group: Any,
    prepare: Callable[[nn.Module, list[nn.Module]], list[nn.Module]] | None = None,
) -> PipelinedModel:
    """Cut ``model`` into ``pp_size x virtual_stages`` stages and keep pipeline rank
    ``pp_index``'s, with their schedule over ``group``. ``prepare(model, parts)`` may split or
    shard the kept stages further (tensor and data parallelism) before they are wrapped."""
    layers = pipeline_layers(model)
    num_stages = pp_size * virtual_stages
    if split_points is not None:
        starts = check_starts(split_points, len(layers), num_stages)
    else:
        starts = balanced_starts(
            [sum(p.numel() for p in m.parameters()) for m in layers], num_stages
        )
    bounds = [*starts, len(layers)]
    mine = [s for s in range(num_stages) if s % pp_size == pp_index]
    owned = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i, layer in enumerate(layers):
        if i not in owned:
            layer.to("meta")  # another rank's stage: free its parameters here
    parts: list[nn.Module] = [nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in mine]
    if prepare is not None:
        parts = prepare(model, parts)
    wrapped = PipelinedModel(model, parts, mine, num_stages)
    wrapped.pp_group = group
    wrapped.schedule = build_schedule(
        wrapped, name=schedule, microbatches=microbatches, device=device, group=group
    )
    return wrapped


def build_schedule(
    model: PipelinedModel,
    *,
    name: str,
    microbatches: int,
    device: torch.device,
    group: Any,
) -> Any:
    """Wrap each part in a ``PipelineStage`` and build the schedule ``name`` over them."""
    stages = [
        PipelineStage(part, index, model.num_stages, device, group=group)
        for part, index in zip(model.parts, model.stage_indices, strict=True)
    ]
    for stage in stages:
        _time_stage(stage, model)
    options: dict[str, Any] = dict(
        n_microbatches=microbatches, loss_fn=model.scaled_loss, scale_grads=False
    )
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, **options)
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], **options)


def _time_stage(stage: PipelineStage, model: PipelinedModel) -> None:
    """Count the time this stage computes (forward and backward chunks) in ``model``."""

    def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                setattr(model, kind, getattr(model, kind) + elapsed)

        return run

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "forward_s")  # type: ignore[method-assign]
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "backward_s")  # type: ignore[method-assign]


def owned_state(model: PipelinedModel) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, named as in the whole model, full (not TP-sharded)."""
    owned = {id(t) for part in model.parts for t in [*part.parameters(), *part.buffers()]}
    state = {}
    for name, tensor in model.root.state_dict(keep_vars=True).items():
        if id(tensor) in owned:
            value = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            state[name] = value.detach().cpu()
    return state


def gather_state(model: PipelinedModel) -> dict[str, torch.Tensor]:
    """The whole model's state dict, assembled from every rank's stages (a collective)."""
    mine = owned_state(model)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return {k: merged[k] for k in model.root.state_dict() if k in merged}


def gather_optimizer_state(
    model: PipelinedModel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Every stage's optimizer state, unsharded and keyed by parameter name, on every rank
    (a collective), in the layout of an unsplit model's optimizer."""
    if len(optimizer.param_groups) != 1:
        raise NotImplementedError(
            "checkpoints of pipelined runs support one optimizer parameter group; this "
            f"optimizer has {len(optimizer.param_groups)}"
        )
    names = {id(p): n for n, p in model.root.named_parameters()}
    mine = {
        names[id(p)]: {k: _full(v) for k, v in entry.items()}
        for p, entry in optimizer.state.items()
    }
    everyone: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    state: dict[str, Any] = {}
    for part in everyone:
        state.update(part)
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(names.values())}]}


def load_full_state(
    model: PipelinedModel, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load unsharded, named model (and optimizer, unless None) state into this rank's stages,
    sharding it like the stages' own (DTensor) parameters."""
    owned = {id(t) for part in model.parts for t in [*part.parameters(), *part.buffers()]}
    with torch.no_grad():
        for name, tensor in model.root.state_dict(keep_vars=True).items():
            if id(tensor) in owned:
                tensor.copy_(_like(tensor, state["model"][name]))
    if state["optimizer"] is None:
        return
    names = {id(p): n for n, p in model.root.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]["state"]
    local = {
        i: {k: _like(p, v) if _is_per_element(p, v) else v for k, v in saved[names[id(p)]].items()}
        for i, p in enumerate(params)
        if names[id(p)] in saved
    }
    group = {k: v for k, v in state["optimizer"]["param_groups"][0].items() if k != "params"}
    optimizer.load_state_dict(
        {"state": local, "param_groups": [{**group, "params": list(range(len(params)))}]}
    )


def _full(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return value.detach().cpu().clone()


def _is_per_element(param: torch.Tensor, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: sharded the same way when ``param`` is a DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = param.to_local()  # type: ignore[attr-defined]
        return distribute_tensor(
            full.to(local.device, local.dtype), param.device_mesh, param.placements
        )
    return full.to(param.device, param.dtype)
