"""What backward holds, layer by layer: the saved activations of a rank's layers (with
activation checkpointing, tensor and sequence parallelism, bf16 autocast), the gradients it
passes back, the largest tensor a gradient is made for, and data parallelism's moments along
backward (``memory_model`` puts them together). Example::

    saved_activations(layers, layout, half=False, measured=False)   # bytes
"""

from __future__ import annotations

import itertools

from axon_nb.estimate.profile import LayerProfile
from axon_nb.estimate.rank_layout import RankLayout


def saved_activations(
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
        saved = saved_per_sample(layer, tp, sequence, half, measured)
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


def saved_per_sample(
    layer: LayerProfile, tp: int, sequence: bool, half: bool, measured: bool
) -> float:
    """A layer's saved activations per sample: fp32, or under bf16 compute as measured under
    autocast (``measured``) or half the fp32 ones."""
    saved = layer.local_saved(tp, sequence, half and measured)
    return saved * 0.5 if half and not measured else saved


def head_before_blocks(
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
    rebuilt = max((saved_per_sample(x, tp, sequence, half, measured) for x in blocks), default=0.0)
    return min(freed, rebuilt * layout.micro_samples)


def saved_after_blocks(
    layers: list[LayerProfile], layout: RankLayout, half: bool, measured: bool
) -> float:
    """Saved activations of the layers after the last block (a final norm, the head), which
    their backward frees before the blocks' backward begins."""
    last = max((i for i, layer in enumerate(layers) if layer.block), default=len(layers) - 1)
    sequence = bool(layout.config.tensor and layout.config.tensor.sequence_parallel)
    tail = layers[last + 1 :]
    saved = sum(saved_per_sample(x, layout.dims.tp, sequence, half, measured) for x in tail)
    return saved * layout.samples_in_flight


def activation_grads(layers: list[LayerProfile]) -> float:
    """Per sample, the most a stage's backward holds of the gradients it passes back at once:
    a layer's output's and the one it makes for its input (the previous layer's output)."""
    outputs = [0.0] + [x.output_bytes for x in layers]
    return max(a + b for a, b in itertools.pairwise(outputs))


def data_parallel_moments(
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
        largest = largest_tensor([layers[k]], layout)
        moments.append({
            "activations": saved_activations(layers[:k], layout, half, measured=autocast),
            "backward": layers[k - 1].output_bytes * layout.micro_samples
            + largest * b,
        })  # fmt: skip
    return moments


def largest_tensor(layers: list[LayerProfile], layout: RankLayout) -> float:
    """Elements of the largest trainable tensor the rank's data parallelism handles (with
    expert parallelism, the experts' are not among them), tensor-parallel ones split."""
    tp, ep = layout.dims.tp, layout.dims.ep
    return max(
        ((x.largest_dense_param if ep > 1 else x.largest_param) / (tp if x.tp_params else 1)
         for x in layers),
        default=0.0,
    )  # fmt: skip


def last_trained(layers: list[LayerProfile]) -> list[LayerProfile]:
    """The last layer with trainable parameters (as a list), or all of them when none has."""
    trained = [x for x in layers if x.params > x.frozen]
    return trained[-1:] or layers
