"""Predicted peak memory of one rank during a training step, by term, and the phase that
holds it.

A step has two high moments: **backward** (its start, when the saved activations are
largest, and the gradients that come as it goes) and the optimizer **step** (the gradients
complete, the activations gone, the optimizer's temporaries). Under data parallelism
backward is also followed layer by layer: when layer ``k``'s largest gradient is made, only
the layers before ``k`` still hold saved activations (a model whose largest tensor is not in
its last layer peaks there). The peak is the larger; a
pipeline's forward and backward interleave (phase ``pipeline``). FSDP without resharding
after forward has a third, at the end of **forward**: every unit whole, and the all-gather
outputs of the last two units (FSDP2 frees one only once the next one's copy-out is done).

With ``P`` the parameters this rank's layers hold (tensor-parallel layers split by ``tp``),
``T`` the trainable ones among them (all but those with ``requires_grad=False``, such as a
LoRA model's base: they have no gradients and no optimizer state), ``b`` bytes per
parameter, ``s`` the shards of its parameters, ``o`` of its optimizer state and ``N`` the
data-parallel ranks:

=============  ==================================================================
``params``     ``P b / s``
``optimizer``  ``T x state bytes / o`` (``optimizer_memory``: Adam two fp32 moments)
``buckets``    DDP (and ZeRO-1's DDP): its gradient buckets, ``T b``, allocated once;
               the gradients are views into them (``gradient_as_bucket_view``). ZeRO-2
               in backward: its largest bucket (the one being filled or reduced)
``grads``      gradients outside buckets at the step: ``T b`` without data parallelism
               (and for DDP with ``gradient_as_bucket_view=False``); ZeRO-2's and FSDP's
               shards, ``T b / N``. In backward none: the peak comes early, where the saved
               activations are largest and the largest gradients (a model's last layers)
               are in buckets (ZeRO-2 reduces a bucket's, FSDP a unit's, after its
               backward: whole in ``gathered``), except in a pipeline, which accumulates
               them whole over its micro-batches: ``T b``
``activations``  saved activations of the rank's layers x the samples in flight (a
               pipeline keeps several micro-batches); with activation checkpointing a
               checkpointed block keeps its input only, and one block's activations are
               rebuilt at a time in backward; tensor parallelism splits the measured
               share of them; under bf16 compute, what the probe measured under bf16
               autocast (some activations stay fp32; it also saves bf16 copies of the
               weights, once per micro-batch in flight), else half the fp32 ones
``backward``   the last layer's backward working set (activation gradients, the loss's
               temporaries) x the samples in flight, plus what does not grow with them
               (both measured at two batch sizes, and again under bf16 autocast), on the
               rank that holds it; on an earlier pipeline stage, the gradients its layers
               pass back (a layer's output's and its input's, the largest pair) x a
               micro-batch's samples;
               and where a gradient is taken from autograd into a bucket (DDP, ZeRO-1,
               ZeRO-2), the one autograd has just made: at the start of backward the last
               trained layer's largest tensor's, at layer ``k`` layer ``k``'s
``pipeline``   a pipeline stage's receive buffers, one per micro-batch (activations in,
               gradients back: ``batch x boundary bytes`` each way it receives; none
               come back to a stage when it and every layer before it are frozen), and
               the weight gradient a micro-batch's backward makes before autograd adds
               it to the accumulated ones (the largest tensor's; under FSDP, which adds
               them unit by unit, the largest unit's)
``experts``    with expert parallelism (``ep`` ranks), the expert parameters ``X`` are
               taken out of ``P`` and ``T`` above and counted as ``X / ep`` of
               parameters, gradients and optimizer state on every rank
``gathered``   FSDP: whole parameters of two units at once (the one running and the
               prefetched next) and one unit's whole gradients on their way into its
               reduce-scatter, less the saved activations of the layers after the
               blocks (the head's): these units are gathered in the blocks' backward,
               after the head's has freed those, and add to the peak only what they
               exceed them by; without resharding after forward, all the units' whole
               parameters (copies beside the shards, which stay) and one unit's
               gradients. A pipeline stage is sharded layer by layer, and FSDP keeps
               each unit whole after its backward until the last micro-batch's: at the
               peak, in the second micro-batch's backward, ``P b`` gathered. A model
               sharded layer by layer (an ``nn.Sequential`` without blocks) peaks at its
               largest layer instead (``_fsdp_layer_moments``), with the gradient shards
               of the layers after it. At the end of forward (a model that computes its
               own loss): the root unit and one more. FSDP gathers in its
               ``param_dtype``; under autocast alone, in fp32
``step``       the optimizer step's temporaries (``optimizer_memory``: by optimizer and
               implementation path, from the largest tensor it steps or all of them)
``strategy``   DiLoCo: the global parameters and the outer momentum, ``2 T b / s`` (one
               copy without momentum); AsyncSGD: the mean gradients in flight,
               ``staleness x T b``
=============  ==================================================================

With FSDP's ``cpu_offload`` the shards of parameters, gradients and optimizer state live in
host memory: they are reported as ``offloaded`` and left out of the device's peak (and the
step runs there); a pipeline's whole accumulated gradients stay on the device. Example::

    terms = predict_memory(profile, layout, optimizer="adamw")
    terms["peak"], terms["phase"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axon_nb.estimate.backward_memory import (
    activation_grads,
    data_parallel_moments,
    head_before_blocks,
    largest_tensor,
    last_trained,
    saved_activations,
    saved_after_blocks,
)
from axon_nb.estimate.fsdp_memory import (
    fsdp_units,
    gathered_after_forward,
    gathered_in_backward,
    layer_sharded_moments,
)
from axon_nb.estimate.optimizer_memory import state_bytes, step_temporaries
from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.estimate.rank_layout import RankLayout

HALF = {"bf16", "fp16"}


@dataclass(frozen=True)
class _Rank:
    """What the terms are computed from: one rank's layers and sizes (elements, not bytes,
    except ``b``, the bytes per parameter element)."""

    layers: list[LayerProfile]
    b: int
    local: float  # parameters held (experts apart)
    trained: float  # trainable parameters held (experts apart)
    mine: float  # expert parameters of this rank's share
    largest: float  # the largest trainable tensor
    half: bool  # bf16 compute (autocast or FSDP's param_dtype)
    autocast: bool  # bf16 autocast (as the probe measured it)
    fsdp: Any  # the FSDP config, or None
    gathered_bytes: int  # bytes per element FSDP gathers in


def predict_memory(
    profile: ModelProfile,
    layout: RankLayout,
    *,
    optimizer: Any = "adamw",
    mixed_precision: str | None = None,
    device_type: str = "cpu",
) -> dict[str, Any]:
    """Bytes of each term (see the module docstring) at the moment that holds the peak,
    their sum ``peak``, that moment's ``phase`` (``backward``, ``step`` or ``pipeline``) and
    ``offloaded``, for one rank. ``optimizer`` as ``train`` takes it (a callable is counted
    as AdamW); ``device_type`` chooses the optimizer's default path (``optimizer_memory``).
    Example::

        predict_memory(profile, layout, optimizer="sgd")["peak"]
    """
    r = _rank(profile, layout, mixed_precision)
    held = _held(r, layout, optimizer)
    in_backward = _in_backward(profile, layout, r, held)
    at_step = _at_step(layout, r, held, optimizer, device_type)
    moments = _moments(profile, layout, r, held, in_backward, at_step)
    offloaded = _offload(layout, r, held, moments) if r.fsdp and r.fsdp.cpu_offload else 0.0
    terms, phase = max(moments, key=lambda m: sum(m[0].values()))
    return {**terms, "peak": sum(terms.values()), "phase": phase, "offloaded": offloaded}


def _rank(profile: ModelProfile, layout: RankLayout, mixed_precision: str | None) -> _Rank:
    tp = layout.dims.tp
    layers = [profile.layers[i] for i in layout.layers]
    # expert parallelism: the experts are split over ep ranks, the rest as the strategy says
    experts = layout.experts(layers)
    fsdp = layout.config.fsdp if layout.kind == "fsdp" else None
    compute = mixed_precision or (fsdp.param_dtype if fsdp is not None else None)
    return _Rank(
        layers=layers,
        b=profile.param_bytes,
        local=sum(layer.local_params(tp) for layer in layers) - experts,
        trained=sum(layer.local_trainable(tp) for layer in layers) - experts,
        mine=experts / layout.dims.ep,
        largest=largest_tensor(layers, layout),
        # bf16 compute: under autocast (mixed_precision) as the probe measured it; FSDP's
        # param_dtype alone computes all in bf16: half the fp32 activations
        half=compute in HALF,
        autocast=mixed_precision in HALF,
        fsdp=fsdp,
        # FSDP gathers in its own param_dtype; autocast casts the gathered fp32 weights later
        gathered_bytes=2 if fsdp is not None and fsdp.param_dtype in HALF else profile.param_bytes,
    )


def _held(r: _Rank, layout: RankLayout, optimizer: Any) -> dict[str, float]:
    """Parameters, optimizer state and a strategy's own state: held at every moment."""
    held = {
        "params": r.local * r.b / layout.param_shards + r.mine * r.b,
        "optimizer": (_stepped(r, layout) + r.mine) * state_bytes(optimizer),
    }
    diloco, stale = layout.config.diloco, layout.config.async_sgd
    if diloco is not None:  # the global parameters, and the outer momentum
        copies = 2 if diloco.outer_momentum > 0 else 1
        held["strategy"] = copies * r.trained * r.b / layout.param_shards
    elif stale is not None and stale.staleness:  # the mean gradients in flight
        held["strategy"] = stale.staleness * r.trained * r.b
    return held


def _stepped(r: _Rank, layout: RankLayout) -> float:
    """Trainable elements this rank's optimizer steps (experts apart). ZeRO-1 gives each
    rank whole tensors: its share is at least the largest."""
    if layout.kind == "zero1":
        return max(r.trained / layout.dims.dp, r.largest)
    return r.trained / layout.optimizer_shards


def _bucket(r: _Rank, layout: RankLayout) -> float:
    """ZeRO-2's largest bucket: a quarter of the model or the cap, at least its largest
    tensor (bytes)."""
    cap = layout.config.bucket_cap_mb * 2**20 / r.b
    return max(r.largest, min(cap, r.trained / 4)) * r.b


def _working_set(profile: ModelProfile, layout: RankLayout, r: _Rank) -> float:
    """The ``backward`` term at the start of backward: the last stage's measured working set
    (under bf16 autocast as the probe measured it there, if it did), an earlier stage's
    activation gradients, and the gradient autograd just made for a bucket (the last trained
    layer's largest)."""
    backward = 0.0
    if layout.last_stage:
        measured = r.autocast and (
            profile.half_backward_extra_bytes or profile.half_backward_fixed_bytes
        )
        backward = (
            profile.half_backward_extra_bytes * layout.micro_samples
            + profile.half_backward_fixed_bytes
            if measured
            else profile.backward_extra_bytes * layout.micro_samples + profile.backward_fixed_bytes
        )
    elif layout.dims.pp > 1:  # an earlier stage: the gradients its layers pass back
        backward = activation_grads(r.layers) * layout.micro_samples
    if layout.kind in ("ddp", "zero1", "zero2"):
        backward += largest_tensor(last_trained(r.layers), layout) * r.b
    return backward


def _in_backward(
    profile: ModelProfile, layout: RankLayout, r: _Rank, held: dict[str, float]
) -> dict[str, float]:
    """The terms at the start of backward (or of the blocks' backward, once the head has
    freed its activations)."""
    kind, b = layout.kind, r.b
    freed = saved_after_blocks(r.layers, layout, r.half, r.autocast)
    activations = saved_activations(r.layers, layout, r.half, measured=r.autocast)
    head = head_before_blocks(r.layers, layout, r.half, r.autocast, freed)
    gathered = gathered_in_backward(
        r.layers, layout, r.gathered_bytes, profile.fsdp_units, freed=freed
    )
    return {
        **held,
        "buckets": _bucket(r, layout) if kind == "zero2" else _buckets(r, layout),
        "grads": _grads(layout, (r.trained + r.mine) * b, in_backward=True),
        "activations": activations - head,
        "backward": _working_set(profile, layout, r),
        "pipeline": _pipeline(profile, layout, _returned_grads(r.layers, layout, b)),
        "gathered": gathered,
    }


def _buckets(r: _Rank, layout: RankLayout) -> float:
    """DDP's (and ZeRO-1's) gradient buckets: every trainable parameter's gradient."""
    return r.trained * r.b if layout.kind in ("ddp", "zero1") else 0.0


def _at_step(
    layout: RankLayout, r: _Rank, held: dict[str, float], optimizer: Any, device_type: str
) -> dict[str, float]:
    """The terms at the optimizer step: whole gradients, the optimizer's temporaries."""
    b = r.b
    if layout.kind == "zero2":
        widest = _bucket(r, layout) / b / layout.dims.dp
    else:
        widest = r.largest / layout.param_shards
    stepped = _stepped(r, layout) + r.mine
    return {
        **held,
        "buckets": _buckets(r, layout),
        "grads": _grads(layout, r.trained * b, in_backward=False) + r.mine * b,
        "step": step_temporaries(
            optimizer, largest=widest * b, total=stepped * b, device_type=device_type
        ),
    }


def _moments(
    profile: ModelProfile,
    layout: RankLayout,
    r: _Rank,
    held: dict[str, float],
    in_backward: dict[str, float],
    at_step: dict[str, float],
) -> list[tuple[dict[str, float], str]]:
    """Every moment that may hold the peak, with its phase."""
    # the activations' moment: where the probe saw them peak (with the loss's temporaries, a
    # model that computes its own loss may peak at the end of forward)
    held_at = profile.half_working_set_phase if r.autocast else profile.working_set_phase
    whole_model = layout.dims.pp == 1
    if held_at == "forward" and r.fsdp is not None and whole_model:
        in_backward["gathered"] = gathered_after_forward(
            r.layers, layout, r.gathered_bytes, profile
        )
    first = "pipeline" if not whole_model else held_at
    layered = layer_sharded_moments(
        r.layers, layout, in_backward, r.gathered_bytes, half=r.half, autocast=r.autocast
    )
    moments = [(m, first) for m in layered]
    moments.append((at_step, "step"))
    if layout.kind in ("ddp", "zero1", "zero2") and whole_model:
        moments += [
            ({**in_backward, **later}, "backward")
            for later in data_parallel_moments(r.layers, layout, r.half, r.autocast, r.b)
        ]
    if r.fsdp is not None and not r.fsdp.reshard_after_forward and whole_model:
        units = fsdp_units(r.layers, layout, layout.dims.tp, profile.fsdp_units)
        whole = [p * r.gathered_bytes for p, _ in units]
        moments.append(({**held, "activations": in_backward["activations"],
                         "gathered": sum(whole) + sum(sorted(whole)[-2:])}, "forward"))  # fmt: skip
    return moments


def _offload(
    layout: RankLayout, r: _Rank, held: dict[str, float], moments: list[tuple[dict, str]]
) -> float:
    """FSDP's ``cpu_offload``: the host keeps the shards and steps them; on the device the
    gradient shards come only after the peak (a pipeline's whole accumulated gradients stay
    on the device). The bytes the host holds; the moments lose them."""
    offloaded = held["params"] + r.trained * r.b / layout.param_shards + held["optimizer"]
    for moment, phase in moments:
        if phase == "step":
            moment.clear()
            continue
        moment.update(params=0.0, optimizer=0.0)
        if layout.dims.pp == 1:
            moment["grads"] = 0.0
    return offloaded


def _pipeline(profile: ModelProfile, layout: RankLayout, weight_grads: float) -> float:
    if layout.dims.pp == 1:
        return 0.0
    samples = layout.micro_samples * layout.microbatches
    received = 0.0
    for stage in layout.stages:
        if stage[0] > 0:  # activations in
            received += profile.layers[stage[0] - 1].output_bytes * samples
        last = stage[-1]
        if last < len(profile.layers) - 1 and profile.carries_gradient(last):  # gradients back
            received += profile.layers[last].output_bytes * samples
    return received + weight_grads


def _grads(layout: RankLayout, trained_bytes: float, *, in_backward: bool) -> float:
    """The ``grads`` term: gradients of ``trained_bytes`` of parameters alive outside
    buckets, in backward or at the optimizer step. In backward none yet at the peak, which
    comes early, where the saved activations are (the moment the gradients are whole is the
    step's, without its temporaries), except in a pipeline, which accumulates them whole
    over its micro-batches."""
    kind = layout.kind
    if in_backward:
        return trained_bytes if layout.dims.pp > 1 else 0.0
    if kind in ("ddp", "zero1"):
        ddp = layout.config.ddp
        return 0.0 if ddp is None or ddp.gradient_as_bucket_view else trained_bytes
    if kind in ("zero2", "fsdp"):
        return (
            trained_bytes / layout.param_shards
            if kind == "fsdp"
            else trained_bytes / layout.dims.dp
        )
    return trained_bytes


def _returned_grads(layers: list[LayerProfile], layout: RankLayout, b: int) -> float:
    """Weight gradients a pipeline micro-batch's backward makes before they are added to the
    accumulated ones: autograd adds each as it comes (the largest tensor's at most), FSDP
    unit by unit (the largest unit's)."""
    if layout.kind != "fsdp":
        return largest_tensor(layers, layout) * b
    return max(t for _, t in fsdp_units(layers, layout, layout.dims.tp, ())) * b
