"""Pipeline parallelism on ``torch.distributed.pipelining``: cutting a model into stages,
building a stage's schedule, and timing it.

A model is cut along its layers: the children of an ``nn.Sequential``, what a model's
``pipeline_layers()`` returns (``axon_nb.models.GPT``: embedding, each block, head), or the
modules of a transformers model's pipeline plan or of ``split`` (``pipeline_plan.py``). Stage s
holds layers ``starts[s] .. starts[s+1]``. With ``v`` virtual stages per rank (interleaved
schedules), pipeline rank r holds stages ``r, r + pp, r + 2pp, ...``. A rank keeps only its
stages' parameters; the rest of the model is moved to the meta device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.parallel.activation_checkpoint import canonical_name, parameter_names
from axon_nb.parallel.optim_state import by_index, by_name, merge_groups
from axon_nb.parallel.pipeline_plan import cannot_cut, first_input_name, has_plan, plan_layers
from axon_nb.spec.parallel_config import PipelineConfig
from axon_nb.spec.pipeline_stages import balanced_starts, check_starts

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def pipeline_layers(model: nn.Module, split: Sequence[str] | None = None) -> list[nn.Module]:
    """The layers a pipeline can cut ``model`` into, in forward order: the modules named in
    ``split``, an ``nn.Sequential``'s children, its ``pipeline_layers()``, or its own plan."""
    if split is not None:
        return plan_layers(model, split)
    if isinstance(model, nn.Sequential):
        return list(model)
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    if has_plan(model):
        return plan_layers(model)
    raise TypeError(cannot_cut(model))


def plan_stages(
    model: nn.Module, pp_index: int, pp_size: int, config: PipelineConfig
) -> tuple[list[int], list[int]]:
    """``(bounds, mine)``: stage s holds layers ``bounds[s] .. bounds[s+1]``, and pipeline rank
    ``pp_index`` runs stages ``mine``. Nothing is changed yet."""
    layers = pipeline_layers(model, config.split)
    num_stages = pp_size * config.virtual_stages
    if config.split_points is not None:
        starts = check_starts(config.split_points, len(layers), num_stages)
    else:
        starts = balanced_starts(
            [sum(p.numel() for p in m.parameters()) for m in layers], num_stages
        )
    mine = [s for s in range(num_stages) if s % pp_size == pp_index]
    return [*starts, len(layers)], mine


def owned_module_names(
    model: nn.Module, bounds: list[int], mine: list[int], split: Sequence[str] | None = None
) -> set[str]:
    """Names of the modules inside this rank's stages."""
    layers = pipeline_layers(model, split)
    kept = [layers[i] for s in mine for i in range(bounds[s], bounds[s + 1])]
    inside = {id(m) for layer in kept for m in layer.modules()}
    return {name for name, m in model.named_modules() if id(m) in inside}


def cut_stages(
    model: nn.Module, bounds: list[int], mine: list[int], split: Sequence[str] | None = None
) -> list[nn.Module]:
    """This rank's stages as ``nn.Sequential``s of the model's layers; every other layer is
    moved to the meta device (its parameters are freed here)."""
    layers = pipeline_layers(model, split)
    owned = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i, layer in enumerate(layers):
        if i not in owned:
            layer.to("meta")
    return [nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in mine]


class PipelinedModel(nn.Module):
    """This rank's stages of a model and their schedule; ``root`` is the whole model (only this
    rank's stages hold real parameters).

    ``parts`` holds the stage modules (possibly sharded), so ``parameters()`` are exactly
    this rank's. Example (what ``parallelize`` does when ``pp > 1``)::

        bounds, mine = plan_stages(model, pp_index, pp_size, config)
        piped = PipelinedModel(model, cut_stages(model, bounds, mine), mine,
                               num_stages=len(bounds) - 1, config=config, device=device,
                               group=pp_group)
        loss = piped.step(microbatches, micro)
    """

    root: nn.Module
    """The whole model (not a submodule: its other ranks' stages are on the meta device)."""

    def __init__(
        self,
        root: nn.Module,
        parts: list[nn.Module],
        stage_indices: list[int],
        *,
        num_stages: int,
        config: PipelineConfig,
        device: torch.device,
        group: Any,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        object.__setattr__(self, "root", root)  # not a submodule: its other stages are meta
        self.stage_indices = stage_indices
        self.num_stages = num_stages
        self.microbatches = config.microbatches
        self.has_first = 0 in stage_indices
        self.has_last = num_stages - 1 in stage_indices
        self.group = group
        """The pipeline's process group (None in a one-rank world)."""
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.last_step: dict[str, float] = {}
        """Stage timing of the latest step: forward_s, backward_s and the bubble share."""
        self._micro: MicroStep | None = None
        self._input_key = first_input_name(root)
        """A Mapping batch's key the first stage reads (``input_ids``)."""
        self._own_loss = getattr(root, "loss_function", None)
        """A transformers model's loss on (logits, labels), for ``loss=None``."""
        self._loss_scale = 1.0
        self.schedule = self._build_schedule(config.schedule, device)

    def step(self, microbatches: Sequence[Any], micro: MicroStep) -> torch.Tensor:
        """Forward and backward of one optimizer step's (input, target) micro-batches through
        the schedule; returns the step's mean loss on the last stage (0 elsewhere)."""
        self._micro = micro
        self._loss_scale = 1.0 / (self.microbatches * len(microbatches))
        before = (self.forward_s, self.backward_s)
        started = time.perf_counter()
        losses: list[torch.Tensor] = []
        for inputs, target in (self.pair(b, micro.loss_fn) for b in microbatches):
            args = (inputs,) if self.has_first else ()
            step_losses: list[torch.Tensor] = []  # the schedule's, one per micro-batch
            with micro.autocast():
                self.schedule.step(
                    *args,
                    target=target if self.has_last else None,
                    losses=step_losses,
                    return_outputs=False,  # the losses are all we use: keep no logits
                )
            losses += [micro.unscale(loss.detach()) for loss in step_losses]
        wall = time.perf_counter() - started
        forward, backward = self.forward_s - before[0], self.backward_s - before[1]
        self.last_step = {
            "forward_s": forward,
            "backward_s": backward,
            "bubble": max(0.0, 1.0 - (forward + backward) / wall),
        }
        if not losses:
            return torch.zeros((), device=next(self.parameters()).device)
        return torch.stack(losses).sum()

    def pair(self, batch: Any, loss_fn: Callable[..., Any] | None) -> tuple[Any, Any]:
        """A micro-batch as (what the first stage reads, what the loss compares with): an
        (input, target) pair as it is (``loss_fn`` is then required); a Mapping as its input
        ids and ``labels``."""
        if not isinstance(batch, Mapping):
            if not (isinstance(batch, tuple | list) and len(batch) == 2):
                raise TypeError(
                    "a pipeline trains on (input, target) pairs or Mappings with input_ids and "
                    f"labels; a batch came as {type(batch).__name__}"
                )
            if loss_fn is None:
                raise ValueError(
                    "a pipeline computes the loss on its last stage: pass loss=loss(output, "
                    "target) (for axon_nb.models.GPT: loss=axon_nb.models.lm_loss), or give "
                    "a transformers model Mapping batches with labels (loss=None)"
                )
            return batch[0], batch[1]
        return mapping_pair(batch, self._input_key, self._own_loss is not None)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss (the user's, or the model's own on its labels), scaled so
        that gradients sum to the step mean (and by the fp16 loss scale, when there is one)."""
        assert self._micro is not None
        loss = self.loss(output, target, self._micro.loss_fn)
        return self._micro.scale(loss.float() * self._loss_scale)

    def loss(
        self, output: torch.Tensor, target: Any, loss_fn: Callable[..., Any] | None
    ) -> torch.Tensor:
        """The last stage's loss of a micro-batch: ``loss_fn(output, target)``, or with None
        the model's own on its labels (a transformers model's ``loss_function``)."""
        if loss_fn is not None:
            return loss_fn(output, target)
        assert self._own_loss is not None
        vocab = getattr(getattr(self.root, "config", None), "vocab_size", output.shape[-1])
        return self._own_loss(logits=output, labels=target, vocab_size=vocab)

    def _build_schedule(self, name: str, device: torch.device) -> Any:
        # (imported here: it loads dynamo and DTensor, 1.5 s of CPU, which a rank that trains
        # without a pipeline never needs)
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        stages = [
            PipelineStage(part, index, self.num_stages, device, group=self.group)
            for part, index in zip(self.parts, self.stage_indices, strict=True)
        ]
        for stage in stages:
            _time_stage(stage, self)
        options: dict[str, Any] = dict(
            n_microbatches=self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        if name == "interleaved_1f1b":  # (a new list: it takes one of their base class)
            return ScheduleInterleaved1F1B([*stages], **options)
        cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        return cls(stages[0], **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipelined model runs through its schedule; train it with cluster.train, or "
            "gather the full model (cluster.save, or trainstate.get(name).parallel."
            "full_state_dict())"
        )


def mapping_pair(batch: Mapping[str, Any], input_key: str, own_loss: bool) -> tuple[Any, Any]:
    """``(batch[input_key], batch["labels"])`` of a Mapping micro-batch, refusing what stages
    cannot carry: keys other than those and an attention mask, and padding on the left (a
    right-padded causal batch's real tokens never see its padding, so no mask is needed)."""
    if "labels" not in batch or input_key not in batch:
        raise ValueError(
            f"a pipeline reads {input_key!r} on its first stage and 'labels' on its last; the "
            f"batch has keys {sorted(map(str, batch))}"
        )
    if not own_loss:
        raise ValueError(
            "Mapping batches under a pipeline train with the model's own loss, which only "
            "transformers models (with a loss_function) have; pass (input, target) pairs and "
            "loss=loss(output, target)"
        )
    extra = sorted(set(map(str, batch)) - {input_key, "labels", "attention_mask"})
    if extra:
        raise ValueError(
            f"pipeline stages pass one tensor on, so a batch can hold only {input_key!r}, "
            f"'labels' and a right-padded 'attention_mask'; it also has {extra}: drop them "
            "(e.g. with remove_columns, or a collate_fn)"
        )
    mask = batch.get("attention_mask")
    left = (  # (a 1 after a 0 in a row: padding on the left)
        isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and bool((mask[:, 1:] > mask[:, :-1]).any())
    )
    if left:
        raise ValueError(
            "a pipeline passes no attention mask between stages, so padding must come "
            "after the tokens: set tokenizer.padding_side = 'right' (padded labels -100)"
        )
    return batch[input_key], batch["labels"]


class MicroStep(Protocol):
    """What a pipeline step needs from the training loop."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    """The user's ``loss(output, target)``; None: the model's own (Mapping batches)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast context (a no-op without mixed precision)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (unchanged without one)."""

    def unscale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the fp16 loss scale (unchanged without one)."""


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

    for method, kind in (("forward_one_chunk", "forward_s"), ("backward_one_chunk", "backward_s")):
        setattr(stage, method, timed(getattr(stage, method), kind))  # (in place: the schedule's)


def owned_state(model: PipelinedModel) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, named as in the whole model, full (not sharded)."""
    owned = {id(t) for part in model.parts for t in [*part.parameters(), *part.buffers()]}
    state = {}
    for name, tensor in model.root.state_dict(keep_vars=True).items():
        if id(tensor) in owned:
            state[canonical_name(name)] = _full(tensor)
    return state


def gather_state(model: PipelinedModel) -> dict[str, torch.Tensor]:
    """The whole model's state dict, assembled from every rank's stages (a collective)."""
    merged = _merge_over_ranks(owned_state(model))
    order = [canonical_name(k) for k in model.root.state_dict()]
    return {k: merged[k] for k in order if k in merged}


def gather_optimizer_state(
    model: PipelinedModel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Every stage's optimizer state, unsharded and keyed by parameter name, on every rank
    (a collective), in the layout of an unsplit model's optimizer."""
    names = parameter_names(model.root)
    local = by_name(optimizer.state_dict(), [names[id(p)] for p in _optimizer_params(optimizer)])
    mine = {n: {k: _full(v) for k, v in entry.items()} for n, entry in local["state"].items()}
    groups = _all_ranks(local["param_groups"])  # every rank holds some of each group
    order = list(names.values())
    return {"state": _merge_over_ranks(mine), "param_groups": merge_groups(groups, order)}


def load_full_state(
    model: PipelinedModel, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load unsharded, named model (and optimizer, unless None) state into this rank's stages,
    sharding it like the stages' own (DTensor) parameters."""
    owned = {id(t) for part in model.parts for t in [*part.parameters(), *part.buffers()]}
    with torch.no_grad():
        for name, tensor in model.root.state_dict(keep_vars=True).items():
            if id(tensor) in owned:
                tensor.copy_(_like(tensor, state["model"][canonical_name(name)]))
    if state["optimizer"] is None:
        return
    names = parameter_names(model.root)
    params = _optimizer_params(optimizer)
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    local = by_index(state["optimizer"], groups)
    local["state"] = {
        i: {k: _like(params[i], v) if _is_per_element(params[i], v) else v for k, v in e.items()}
        for i, e in local["state"].items()
    }
    optimizer.load_state_dict(local)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _merge_over_ranks(mine: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``mine`` (a collective), on every rank."""
    merged: dict[str, Any] = {}
    for part in _all_ranks(mine):
        merged.update(part)
    return merged


def _all_ranks(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective), on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


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
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = cast(DTensor, param)
        local = sharded.to_local()
        return distribute_tensor(
            full.to(local.device, local.dtype), sharded.device_mesh, sharded.placements
        )
    return full.to(param.device, param.dtype)
