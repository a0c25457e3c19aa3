"""Predicted peak memory of one rank during a training step, by term.

With ``P`` the parameters this rank's layers hold (tensor-parallel layers split by ``tp``),
``T`` the trainable ones among them (all but those with ``requires_grad=False``, such as a
LoRA model's base: they have no gradients and no optimizer state), ``b`` bytes per
parameter, ``s`` the shards of its parameters and ``o`` of its optimizer state:

=============  ==================================================================
``params``     ``P b / s``
``optimizer``  ``T x state bytes / o`` (Adam: two fp32 moments, 8 bytes; SGD: 4 or 0)
``buckets``    DDP (and ZeRO-1's DDP): its gradient buckets, ``T b``, allocated once
``rebuild``    DDP: ``T b`` more at the second step, when DDP rebuilds its buckets in
               the order gradients arrived (the old ones go after); with activation
               checkpointing ``2 T b``: the peak then comes late in backward, when the
               gradients and their copies in the buckets are both whole
``grads``      ``T b``; none under FSDP (sharded or not): each unit's reduce-scatter
               makes its gradients after the unit's backward, and at the peak, in the
               first units' backward, that unit's whole gradients are in ``gathered`` and
               (almost) none exist yet. In a pipeline FSDP accumulates whole
               gradients over the micro-batches and reduce-scatters after the last:
               ``T b``
``activations``  saved activations of the rank's layers x the samples in flight (a
               pipeline keeps several micro-batches); with activation checkpointing a
               checkpointed block keeps its input only, and one block's activations are
               rebuilt at a time in backward; tensor parallelism splits the measured
               share of them; 16-bit compute halves them
``backward``   the last layer's backward working set (activation gradients, the loss's
               temporaries) x the samples in flight, on the rank that holds it; not
               halved by 16-bit compute: at the peak it is the loss's gradient, which
               losses compute in fp32 (autocast's cross entropy does, ``lm_loss`` too)
``pipeline``   a pipeline stage's receive buffers, one per micro-batch (activations in,
               gradients back: ``batch x boundary bytes`` each way it receives; none
               come back to a stage when it and every layer before it are frozen), and
               ``T b`` of weight gradients a micro-batch's backward returns before they
               are added to the accumulated ones (under FSDP, which adds them unit by
               unit, the largest unit's)
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
               peak, in the second micro-batch's backward, ``P b`` gathered
=============  ==================================================================

The peak is their sum: the terms are those alive at the start of backward, when the
activations are largest. With FSDP's ``cpu_offload`` the shards of parameters, gradients and
optimizer state live in host memory: they are reported as ``offloaded`` and left out of the
device's peak. Example::

    predict_memory(profile, layout, optimizer="adamw")["peak"]
"""

from __future__ import annotations

from typing import Any

from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.estimate.rank_layout import RankLayout

OPTIMIZER_STATE_BYTES = {
    "adam": 8, "adamw": 8, "adamax": 8, "nadam": 8, "radam": 8,  # two moments
    "adagrad": 4, "rmsprop": 4, "sgd": 0,  # one sum or average; SGD: none without momentum
}  # fmt: skip
"""Optimizer state bytes per fp32 parameter, by ``train``'s optimizer names."""
HALF = {"bf16", "fp16"}


def predict_memory(
    profile: ModelProfile,
    layout: RankLayout,
    *,
    optimizer: Any = "adamw",
    mixed_precision: str | None = None,
) -> dict[str, float]:
    """Bytes of each term (see the module docstring) and their sum, ``peak``, for one rank.
    ``optimizer`` as ``train`` takes it (a callable is counted as Adam)."""
    tp, b = layout.dims.tp, profile.param_bytes
    layers = [profile.layers[i] for i in layout.layers]
    # expert parallelism: the experts are split over ep ranks, the rest as the strategy says
    experts = layout.experts(layers)
    local = sum(layer.local_params(tp) for layer in layers) - experts
    trained = sum(layer.local_trainable(tp) for layer in layers) - experts
    mine = experts / layout.dims.ep
    fsdp = layout.config.fsdp if layout.kind == "fsdp" else None
    compute = mixed_precision or (fsdp.param_dtype if fsdp is not None else None)
    half = 0.5 if compute in HALF else 1.0
    replicated = layout.kind in ("ddp", "zero1")
    # the loss's gradient and temporaries, in fp32 whatever the compute dtype
    backward = profile.backward_extra_bytes * layout.micro_samples if layout.last_stage else 0.0
    gathered_bytes = b if compute not in HALF else 2
    freed = half * _saved_after_blocks(layers, layout)  # before FSDP gathers in backward
    terms = {
        "params": local * b / layout.param_shards + mine * b,
        "optimizer": (trained / layout.optimizer_shards + mine) * state_bytes(optimizer),
        "buckets": trained * b if replicated else 0.0,
        "rebuild": trained * b * (2 if layout.config.activation_checkpointing else 1)
        if replicated
        else 0.0,
        "grads": _grads(layout, trained * b) + mine * b,
        "activations": half * _activations(layers, layout),
        "backward": backward,
        "pipeline": _pipeline(profile, layout, _returned_grads(layers, layout, trained * b, b)),
        "gathered": _gathered(layers, layout, tp, gathered_bytes, freed=freed),
    }
    offloaded = 0.0
    if fsdp is not None and fsdp.cpu_offload:
        # the host keeps the gradient shards, which on the device come only after the peak
        grads = max(terms["grads"], trained * b / layout.param_shards)
        offloaded = terms["params"] + grads + terms["optimizer"]
        terms.update(params=0.0, grads=0.0, optimizer=0.0)
    terms["peak"] = sum(terms.values())
    terms["offloaded"] = offloaded
    return terms


def state_bytes(optimizer: Any) -> int:
    """Optimizer state bytes per parameter for ``optimizer`` (a name, ``(name, kwargs)`` or a
    callable: counted as Adam)."""
    if callable(optimizer):
        return 8
    name, kwargs = (optimizer, {}) if isinstance(optimizer, str) else optimizer
    if name.lower() not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"no optimizer-state size for optimizer {name!r}; use one of "
            f"{', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    extra = 4 if name.lower() in ("sgd", "rmsprop") and (kwargs or {}).get("momentum") else 0
    return OPTIMIZER_STATE_BYTES[name.lower()] + extra


def _activations(layers: list[LayerProfile], layout: RankLayout) -> float:
    tp, every = layout.dims.tp, layout.config.activation_checkpointing
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    per_sample, rebuilt, block_index = 0.0, 0.0, 0
    previous_output = 0.0
    for layer in layers:
        saved = layer.local_saved(tp, sequence)
        if layer.block and every and block_index % every == 0:
            per_sample += previous_output  # the checkpointed block's input
            rebuilt = max(rebuilt, saved)
        else:
            per_sample += saved
        block_index += layer.block
        previous_output = layer.output_bytes
    return per_sample * layout.samples_in_flight + rebuilt * layout.micro_samples


def _saved_after_blocks(layers: list[LayerProfile], layout: RankLayout) -> float:
    """Saved activations of the layers after the last block (a final norm, the head), which
    their backward frees before the blocks' backward begins."""
    last = max((i for i, layer in enumerate(layers) if layer.block), default=len(layers) - 1)
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    tail = layers[last + 1 :]
    return sum(x.local_saved(layout.dims.tp, sequence) for x in tail) * layout.samples_in_flight


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


def _grads(layout: RankLayout, trained_bytes: float) -> float:
    """The ``grads`` term: gradients of ``trained_bytes`` of parameters alive at the peak."""
    if layout.kind == "fsdp" and layout.dims.pp == 1:
        return 0.0  # each unit's reduce-scatter makes its gradients after its backward: none yet
    return trained_bytes  # (a pipeline accumulates them whole over its micro-batches)


def _returned_grads(
    layers: list[LayerProfile], layout: RankLayout, trained_bytes: float, b: int
) -> float:
    """Weight gradients a pipeline micro-batch's backward returns before they are added to
    the accumulated ones: all the stage's ``trained_bytes``, or under FSDP (which adds them
    unit by unit) the largest unit's."""
    if layout.kind != "fsdp":
        return trained_bytes
    return max(t for _, t in _units(layers, layout, layout.dims.tp)) * b


def _units(layers: list[LayerProfile], layout: RankLayout, tp: int) -> list[tuple[float, float]]:
    """(parameters, trainable parameters) of each FSDP unit: the blocks and the rest, or
    in a pipeline stage each layer (``parallel.fsdp``); experts stay outside, sharded on
    their own axis."""

    def own(layer: LayerProfile) -> float:
        return layout.experts([layer])

    if layout.dims.pp > 1:
        return [(x.local_params(tp) - own(x), x.local_trainable(tp) - own(x)) for x in layers]
    blocks = [layer for layer in layers if layer.block]
    rest = [layer for layer in layers if not layer.block]
    units = [(x.local_params(tp) - own(x), x.local_trainable(tp) - own(x)) for x in blocks]
    units.append((sum(x.local_params(tp) - own(x) for x in rest),
                  sum(x.local_trainable(tp) - own(x) for x in rest)))  # fmt: skip
    return units


def _gathered(
    layers: list[LayerProfile], layout: RankLayout, tp: int, b: int, *, freed: float
) -> float:
    if layout.kind != "fsdp" or layout.param_shards == 1:
        return 0.0
    assert layout.config.fsdp is not None
    units = _units(layers, layout, tp)
    if layout.dims.pp > 1:  # every unit stays whole after its backward until the last one's
        return sum(p for p, _ in units) * b
    whole = sorted(p for p, _ in units)  # whole copies, beside the shards
    if not layout.config.fsdp.reshard_after_forward:  # all whole since the forward
        return (sum(whole) + max(t for _, t in units)) * b
    # gathered again in backward: the unit running and the prefetched next, once the layers
    # after the blocks have freed their saved activations (the peak is the larger moment)
    return max(0.0, (sum(whole[-2:]) + max(t for _, t in units)) * b - freed)
