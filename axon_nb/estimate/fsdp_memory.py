"""FSDP's terms: its units (what it shards and gathers as one), the whole parameters and
gradients gathered at its moments in backward and at the end of forward, and the moments of a
model sharded layer by layer (``memory_model`` puts them together). Example::

    fsdp_units(layers, layout, tp=1, inner=())   # [(parameters, trainable), ...]
"""

from __future__ import annotations

from axon_nb.estimate.backward_memory import saved_activations
from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.estimate.rank_layout import RankLayout


def fsdp_units(
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


def layer_sharded_moments(
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
        "activations": saved_activations(layers[: i + 1], layout, half, measured=autocast),
        "backward": (outputs[i] + outputs[i + 1]) * layout.micro_samples,
        "grads": sum(trained[i + 1 :]) * b / layout.param_shards,
    }
    whole = [p for p in params if p]
    start = {**in_backward, "gathered": sum(whole[-2:]) * b}
    return [at_largest, start]


def gathered_after_forward(
    layers: list[LayerProfile], layout: RankLayout, b: int, profile: ModelProfile
) -> float:
    """FSDP at the end of forward, where a model that computes its own loss peaks: no
    gradient yet; the root unit whole (FSDP2 never reshards it after forward: backward needs
    it first) and one unit more (the last to run, or the first of backward gathered
    early). Without resharding after forward, every unit whole."""
    units = [p for p, _ in fsdp_units(layers, layout, layout.dims.tp, profile.fsdp_units)]
    if layout.param_shards == 1:
        return 0.0
    if not layout.config.fsdp or not layout.config.fsdp.reshard_after_forward:
        return sum(units) * b
    return (units[-1] + max(units[:-1], default=0.0)) * b


def gathered_in_backward(
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
    units = fsdp_units(layers, layout, layout.dims.tp, inner)
    if layout.dims.pp > 1:  # every unit stays whole after its backward until the last one's
        return sum(p for p, _ in units) * b
    whole = sorted(p for p, _ in units)  # whole copies, beside the shards
    if not layout.config.fsdp.reshard_after_forward:  # all whole since the forward
        return (sum(whole) + max(t for _, t in units)) * b
    # gathered again in backward: the unit running and the prefetched next, once the layers
    # after the blocks have freed their saved activations (the peak is the larger moment)
    return max(0.0, (sum(whole[-2:]) + max(t for _, t in units)) * b - freed)
