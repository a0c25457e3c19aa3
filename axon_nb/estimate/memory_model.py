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
=============  ==================================================================

With FSDP's ``cpu_offload`` the shards of parameters, gradients and optimizer state live in
host memory: they are reported as ``offloaded`` and left out of the device's peak (and the
step runs there); a pipeline's whole accumulated gradients stay on the device. Example::

    terms = predict_memory(profile, layout, optimizer="adamw")
    terms["peak"], terms["phase"]
"""

from __future__ import annotations

import itertools
from typing import Any

from axon_nb.estimate.optimizer_memory import state_bytes, step_temporaries
from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.estimate.rank_layout import RankLayout

HALF = {"bf16", "fp16"}


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
    as AdamW); ``device_type`` chooses the optimizer's default path (``optimizer_memory``)."""
    tp, b = layout.dims.tp, profile.param_bytes
    layers = [profile.layers[i] for i in layout.layers]
    # expert parallelism: the experts are split over ep ranks, the rest as the strategy says
    experts = layout.experts(layers)
    local = sum(layer.local_params(tp) for layer in layers) - experts
    trained = sum(layer.local_trainable(tp) for layer in layers) - experts
    mine = experts / layout.dims.ep
    fsdp = layout.config.fsdp if layout.kind == "fsdp" else None
    compute = mixed_precision or (fsdp.param_dtype if fsdp is not None else None)
    # bf16 compute: under autocast (mixed_precision) as the probe measured it; FSDP's
    # param_dtype alone computes all in bf16: half the fp32 activations
    half = compute in HALF
    autocast = mixed_precision in HALF
    kind, dp = layout.kind, layout.dims.dp
    largest = _largest(layers, layout)
    buckets = trained * b if kind in ("ddp", "zero1") else 0.0
    # ZeRO-2's largest bucket: a quarter of the model or the cap, at least its largest tensor
    bucket = max(largest, min(layout.config.bucket_cap_mb * 2**20 / b, trained / 4)) * b
    # ZeRO-1 gives each rank whole tensors: its share is at least the largest
    share = max(trained / dp, largest) if kind == "zero1" else trained / layout.optimizer_shards
    held = {
        "params": local * b / layout.param_shards + mine * b,
        "optimizer": (share + mine) * state_bytes(optimizer),
    }
    # activation gradients and the loss's temporaries
    backward = 0.0
    if layout.last_stage:  # (under bf16 compute as the probe measured it there, if it did)
        measured = autocast and (
            profile.half_backward_extra_bytes or profile.half_backward_fixed_bytes
        )
        backward = (
            profile.half_backward_extra_bytes * layout.micro_samples
            + profile.half_backward_fixed_bytes
            if measured
            else profile.backward_extra_bytes * layout.micro_samples + profile.backward_fixed_bytes
        )
    elif layout.dims.pp > 1:  # an earlier stage: the gradients its layers pass back
        backward = _activation_grads(layers) * layout.micro_samples
    if kind in ("ddp", "zero1", "zero2"):
        # the gradient autograd just made, before the bucket takes it: at the start of
        # backward, the last trained layer's
        backward += _largest(_last_trained(layers), layout) * b
    # FSDP gathers in its own param_dtype; autocast casts the gathered fp32 weights later
    gathered_bytes = 2 if fsdp is not None and fsdp.param_dtype in HALF else b
    freed = _saved_after_blocks(layers, layout, half, autocast)  # before the blocks' backward
    in_backward = {
        **held,
        "buckets": bucket if kind == "zero2" else buckets,
        "grads": _grads(layout, (trained + mine) * b, in_backward=True),
        "activations": _activations(layers, layout, half, measured=autocast)
        - _head_before_blocks(layers, layout, half, autocast, freed),
        "backward": backward,
        "pipeline": _pipeline(profile, layout, _returned_grads(layers, layout, b)),
        "gathered": _gathered(layers, layout, gathered_bytes, profile.fsdp_units, freed=freed),
    }
    stepped = share + mine
    widest = bucket / b / dp if kind == "zero2" else largest / layout.param_shards
    at_step = {
        **held,
        "buckets": buckets,
        "grads": _grads(layout, trained * b, in_backward=False) + mine * b,
        "step": step_temporaries(
            optimizer, largest=widest * b, total=stepped * b, device_type=device_type
        ),
    }
    # the activations' moment: where the probe saw them peak (with the loss's temporaries, a
    # model that computes its own loss may peak at the end of forward)
    held_at = profile.half_working_set_phase if autocast else profile.working_set_phase
    if held_at == "forward" and fsdp is not None and layout.dims.pp == 1:
        in_backward["gathered"] = _gathered_after_forward(layers, layout, gathered_bytes, profile)
    first = "pipeline" if layout.dims.pp > 1 else held_at
    moments = [(m, first) for m in _fsdp_layer_moments(layers, layout, in_backward,
                                                       gathered_bytes, half=half,
                                                       autocast=autocast)]  # fmt: skip
    moments.append((at_step, "step"))
    if kind in ("ddp", "zero1", "zero2") and layout.dims.pp == 1:
        moments += [
            ({**in_backward, **layer_moment}, "backward")
            for layer_moment in _layer_moments(layers, layout, half, autocast, b)
        ]
    if fsdp is not None and not fsdp.reshard_after_forward and layout.dims.pp == 1:
        whole = [p * gathered_bytes for p, _ in _units(layers, layout, tp, profile.fsdp_units)]
        moments.append(({**held, "activations": in_backward["activations"],
                         "gathered": sum(whole) + sum(sorted(whole)[-2:])}, "forward"))  # fmt: skip
    offloaded = 0.0
    if fsdp is not None and fsdp.cpu_offload:
        # the host keeps the shards and steps them; on the device the gradient shards come
        # only after the peak (a pipeline's whole accumulated gradients stay on the device)
        offloaded = held["params"] + trained * b / layout.param_shards + held["optimizer"]
        for moment, _ in moments:
            moment.update(params=0.0, optimizer=0.0)
            if layout.dims.pp == 1:
                moment["grads"] = 0.0
        at_step.clear()
    terms, phase = max(moments, key=lambda m: sum(m[0].values()))
    terms = dict(terms)
    terms["peak"] = sum(terms.values())
    terms["phase"] = phase
    terms["offloaded"] = offloaded
    return terms


def _activations(
    layers: list[LayerProfile], layout: RankLayout, half: bool, *, measured: bool
) -> float:
    """Saved activations of the rank's layers (``half``: under bf16 compute; ``measured``:
    under autocast, as the probe measured them, with the weight copies autocast saves once
    per micro-batch in flight, else half the fp32 ones)."""
    tp, every = layout.dims.tp, layout.config.activation_checkpointing
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    per_sample, rebuilt, block_index, fixed = 0.0, 0.0, 0, 0.0
    previous_output = 0.0
    for layer in layers:
        saved = _saved(layer, tp, sequence, half, measured)
        if layer.block and every and block_index % every == 0:
            per_sample += previous_output * (0.5 if half else 1.0)  # the block's input
            rebuilt = max(rebuilt, saved)
        else:
            per_sample += saved
            fixed += layer.local_fixed(tp, half and measured)
        block_index += layer.block
        previous_output = layer.output_bytes
    in_flight = layout.samples_in_flight / layout.micro_samples
    rebuilt *= layout.micro_samples
    return per_sample * layout.samples_in_flight + rebuilt + fixed * in_flight


def _layer_moments(
    layers: list[LayerProfile], layout: RankLayout, half: bool, autocast: bool, b: int
) -> list[dict[str, float]]:
    """Data parallelism's moments later in backward, one per trained layer ``k`` before the
    last: the gradient autograd has just made for ``k``'s largest tensor (its bucket takes it
    next), the gradient of ``k``'s input autograd passes on, and the saved activations of the
    layers before ``k`` only (``k``'s own are freed once its backward has run; the later
    layers' before; under autocast the gradient of the tensor's bf16 copy is freed once it
    is cast, before the bucket takes the fp32 one). A model whose largest tensor is not in
    its last layer peaks here."""
    moments = []
    for k in range(1, len(layers) - 1):
        if layers[k].local_trainable(layout.dims.tp) == 0:
            continue
        largest = _largest([layers[k]], layout)
        moments.append({
            "activations": _activations(layers[:k], layout, half, measured=autocast),
            "backward": layers[k - 1].output_bytes * layout.micro_samples
            + largest * b,
        })  # fmt: skip
    return moments


def _activation_grads(layers: list[LayerProfile]) -> float:
    """Per sample, the most a stage's backward holds of the gradients it passes back at once:
    a layer's output's and the one it makes for its input (the previous layer's output)."""
    outputs = [0.0] + [x.output_bytes for x in layers]
    return max(a + b for a, b in itertools.pairwise(outputs))


def _last_trained(layers: list[LayerProfile]) -> list[LayerProfile]:
    """The last layer with trainable parameters (as a list), or all of them when none has."""
    trained = [x for x in layers if x.params > x.frozen]
    return trained[-1:] or layers


def _saved(layer: LayerProfile, tp: int, sequence: bool, half: bool, measured: bool) -> float:
    """A layer's saved activations per sample: fp32, or under bf16 compute as measured under
    autocast (``measured``) or half the fp32 ones."""
    saved = layer.local_saved(tp, sequence, half and measured)
    return saved * 0.5 if half and not measured else saved


def _head_before_blocks(
    layers: list[LayerProfile], layout: RankLayout, half: bool, measured: bool, freed: float
) -> float:
    """With activation checkpointing, the layers after the blocks (the head) free their saved
    activations in their backward, before the first block is rebuilt: the two are not alive
    at once, and the smaller is left out (FSDP's ``gathered`` term already leaves the head's
    out of its units' moment)."""
    if not layout.config.activation_checkpointing or layout.kind == "fsdp":
        return 0.0
    blocks = [x for x in layers if x.block]
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    tp = layout.dims.tp
    rebuilt = max((_saved(x, tp, sequence, half, measured) for x in blocks), default=0.0)
    return min(freed, rebuilt * layout.micro_samples)


def _saved_after_blocks(
    layers: list[LayerProfile], layout: RankLayout, half: bool, measured: bool
) -> float:
    """Saved activations of the layers after the last block (a final norm, the head), which
    their backward frees before the blocks' backward begins."""
    last = max((i for i, layer in enumerate(layers) if layer.block), default=len(layers) - 1)
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    tail = layers[last + 1 :]
    saved = sum(_saved(x, layout.dims.tp, sequence, half, measured) for x in tail)
    return saved * layout.samples_in_flight


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


def _largest(layers: list[LayerProfile], layout: RankLayout) -> float:
    """Elements of the largest trainable tensor the rank's data parallelism handles (with
    expert parallelism, the experts' are not among them), tensor-parallel ones split."""
    tp, ep = layout.dims.tp, layout.dims.ep
    return max(
        ((x.largest_dense_param if ep > 1 else x.largest_param) / (tp if x.tp_params else 1)
         for x in layers),
        default=0.0,
    )  # fmt: skip


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
        return _largest(layers, layout) * b
    return max(t for _, t in _units(layers, layout, layout.dims.tp, ())) * b


def _units(
    layers: list[LayerProfile], layout: RankLayout, tp: int, inner: tuple[tuple[int, int], ...]
) -> list[tuple[float, float]]:
    """(parameters, trainable parameters) of each FSDP unit (``parallel.fsdp``): the blocks
    and the rest; each layer of a pipeline stage or of an ``nn.Sequential`` without blocks;
    for a model profiled whole, the entries of its ``nn.ModuleList`` s (``inner``) and the
    rest. Experts stay outside, sharded on their own axis."""

    def own(layer: LayerProfile) -> float:
        return layout.experts([layer])

    def whole(group: list[LayerProfile]) -> tuple[float, float]:
        return (sum(x.local_params(tp) - own(x) for x in group),
                sum(x.local_trainable(tp) - own(x) for x in group))  # fmt: skip

    blocks = [layer for layer in layers if layer.block]
    if len(layers) == 1 and inner and layout.dims.pp == 1:
        params, trained = whole(layers)
        scale = params / max(1, layers[0].params)  # (tensor parallelism's share)
        units = [(p * scale, t * scale) for p, t in inner]
        rest = (params - sum(p for p, _ in units), trained - sum(t for _, t in units))
        return [*units, (max(0.0, rest[0]), max(0.0, rest[1]))]
    if layout.dims.pp > 1 or not blocks:
        return [whole([x]) for x in layers]
    return [whole([x]) for x in blocks] + [whole([x for x in layers if not x.block])]


def _fsdp_layer_moments(
    layers: list[LayerProfile],
    layout: RankLayout,
    in_backward: dict[str, float],
    b: int,
    *,
    half: bool,
    autocast: bool,
) -> list[dict[str, float]]:
    """FSDP on a model sharded layer by layer (an ``nn.Sequential`` without blocks): its
    moment in backward is at the largest layer (the first of the largest, in forward
    order), not at the start: the layers up to it hold saved activations, the gradients it
    passes back are alive, two layers are whole (it and the prefetched one) with its
    gradients, and the layers after it have reduce-scattered theirs into shards. The start
    of backward has all the activations and the backward working set, and the last two
    layers whole, no gradient yet. Models with blocks keep ``in_backward`` (the start of the
    blocks' backward)."""
    if layout.kind != "fsdp" or layout.dims.pp > 1 or layout.param_shards == 1:
        return [in_backward]
    if any(x.block for x in layers) or len(layers) < 2:
        return [in_backward]
    params = [x.local_params(layout.dims.tp) for x in layers]
    trained = [x.local_trainable(layout.dims.tp) for x in layers]
    i = max(range(len(layers)), key=lambda k: (params[k], -k))
    outputs = [0.0] + [x.output_bytes for x in layers]
    at_largest = {
        **in_backward,
        "activations": _activations(layers[: i + 1], layout, half, measured=autocast),
        "backward": (outputs[i] + outputs[i + 1]) * layout.micro_samples,
        "grads": sum(trained[i + 1 :]) * b / layout.param_shards,
    }
    whole = [p for p in params if p]
    start = {**in_backward, "gathered": sum(whole[-2:]) * b}
    return [at_largest, start]


def _gathered_after_forward(
    layers: list[LayerProfile], layout: RankLayout, b: int, profile: ModelProfile
) -> float:
    """FSDP at the end of forward, where a model that computes its own loss peaks: no
    gradient yet; the root unit whole (FSDP2 never reshards it after forward: backward needs
    it first) and one unit more (the last to run, or the first of backward gathered
    early). Without resharding after forward, every unit whole."""
    units = [p for p, _ in _units(layers, layout, layout.dims.tp, profile.fsdp_units)]
    if layout.param_shards == 1:
        return 0.0
    if not layout.config.fsdp or not layout.config.fsdp.reshard_after_forward:
        return sum(units) * b
    return (units[-1] + max(units[:-1], default=0.0)) * b


def _gathered(
    layers: list[LayerProfile],
    layout: RankLayout,
    b: int,
    inner: tuple[tuple[int, int], ...],
    *,
    freed: float,
) -> float:
    if layout.kind != "fsdp" or layout.param_shards == 1:
        return 0.0
    assert layout.config.fsdp is not None
    units = _units(layers, layout, layout.dims.tp, inner)
    if layout.dims.pp > 1:  # every unit stays whole after its backward until the last one's
        return sum(p for p, _ in units) * b
    whole = sorted(p for p, _ in units)  # whole copies, beside the shards
    if not layout.config.fsdp.reshard_after_forward:  # all whole since the forward
        return (sum(whole) + max(t for _, t in units)) * b
    # gathered again in backward: the unit running and the prefetched next, once the layers
    # after the blocks have freed their saved activations (the peak is the larger moment)
    return max(0.0, (sum(whole[-2:]) + max(t for _, t in units)) * b - freed)
