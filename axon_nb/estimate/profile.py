"""``ModelProfile``: what the predictions know about a model, as plain data.

It is measured by one forward and backward of the real model in a process with torch
(``axon_nb.rank.observe.model_probe``: on a rank with :meth:`Cluster.profile`, or in a short-lived
subprocess by :func:`axon_nb.estimate.profile`), never in the kernel. Per-sample figures scale
with the samples a rank processes at once.

Example::

    profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
    profile.params, [layer.name for layer in profile.layers]
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerProfile:
    """One layer a pipeline could cut at (the whole model when it has no layers)."""

    name: str
    params: int
    """Parameter count."""
    tp_params: int = 0
    """Parameters a tensor-parallel plan splits."""
    block: bool = False
    """An ``nn.ModuleList`` entry: activation checkpointing wraps it, FSDP shards it as a
    unit of its own."""
    saved_bytes: float = 0.0
    """Activations autograd keeps for backward, per sample."""
    output_bytes: float = 0.0
    """The layer's output per sample (what a pipeline stage sends on)."""
    colwise_in_bytes: float = 0.0
    """Inputs of its column-parallel linears per sample (tensor parallelism's backward
    all-reduces)."""
    rowwise_out_bytes: float = 0.0
    """Outputs of its row-parallel linears per sample (the forward all-reduces)."""
    colwise_group_bytes: float = 0.0
    """Distinct inputs of its column-parallel linears per sample (sequence parallelism
    gathers each once)."""
    split_fraction: float = 0.0
    """Share of ``saved_bytes`` tensor parallelism splits."""
    frozen: int = 0
    """Parameters that do not train (``requires_grad=False``, e.g. a LoRA model's base): they
    have no gradients and no optimizer state, and no strategy communicates gradients for
    them."""
    half_saved_bytes: float = 0.0
    """Activations autograd keeps per sample under bf16 autocast (0: not measured)."""
    half_saved_fixed: float = 0.0
    """What it keeps under bf16 autocast whatever the samples: bf16 copies of its weights."""
    largest_param: int = 0
    """Elements of its largest trainable tensor (what a gradient or an optimizer's
    per-tensor temporary holds at most at once)."""
    largest_dense_param: int = 0
    """The same leaving out stacked experts (which expert parallelism splits and data
    parallelism leaves to it)."""
    tp_frozen: int = 0
    """Of ``frozen``, those a tensor-parallel plan splits."""
    expert_params: int = 0
    """Parameters of its stacked experts modules (expert parallelism splits them over ``ep``
    ranks; data parallelism leaves them to it)."""
    experts: int = 0
    """Experts of its MoE modules, summed: expert parallelism exchanges a count per expert
    (8 bytes) in each forward."""
    routed_bytes: float = 0.0
    """Per sample: the hidden vectors of its (token, expert) assignments, what expert
    parallelism's all-to-all sends one way."""

    def local_params(self, tp: int) -> float:
        """Parameters one of ``tp`` tensor-parallel ranks holds."""
        return self.params - self.tp_params + self.tp_params / tp

    def local_trainable(self, tp: int) -> float:
        """Trainable parameters one of ``tp`` tensor-parallel ranks holds."""
        split = self.tp_params - self.tp_frozen
        return self.params - self.frozen - split + split / tp

    def local_saved(self, tp: int, sequence_parallel: bool = False, half: bool = False) -> float:
        """Saved activations per sample on one of ``tp`` tensor-parallel ranks (``half``:
        under bf16 autocast, as measured, else half the fp32 ones). Sequence parallelism
        splits the rest of a block's too, except the gathered inputs of its column-parallel
        linears, which they save whole."""
        saved = self.saved_bytes
        if half:
            saved = self.half_saved_bytes or self.saved_bytes / 2
        if sequence_parallel and self.block and tp > 1:
            whole = min(self.colwise_group_bytes, saved)
            return (saved - whole) / tp + whole
        return saved * (1 - self.split_fraction + self.split_fraction / tp)

    def local_fixed(self, tp: int, half: bool) -> float:
        """What it saves whatever the samples (under bf16 autocast: copies of its weights),
        on one of ``tp`` tensor-parallel ranks."""
        if not half:
            return 0.0
        return self.half_saved_fixed * (1 - self.split_fraction + self.split_fraction / tp)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """A model's layers and sizes (see the module docstring)."""

    layers: tuple[LayerProfile, ...]
    param_bytes: int = 4
    """Bytes per parameter element as stored (4: fp32)."""
    backward_extra_bytes: float = 0.0
    """Per sample: the bytes alive at the probe's peak (``working_set_phase``: the start of
    backward, or the end of forward for a model whose own loss peaks there) beyond the saved
    activations, the parameter gradients left out: activation gradients and the loss's
    temporaries, the part that grows with the samples (measured at two batch sizes)."""
    backward_fixed_bytes: float = 0.0
    """The part of that working set that does not grow with the samples (measured at two
    batch sizes): e.g. a stacked experts weight's gradient pieces before they are summed."""
    half_backward_extra_bytes: float = 0.0
    """``backward_extra_bytes`` under bf16 autocast (0: not measured)."""
    half_backward_fixed_bytes: float = 0.0
    """``backward_fixed_bytes`` under bf16 autocast."""
    working_set_phase: str = "backward"
    """Where the probe's activations and working set peaked: ``backward``, or ``forward``
    for a model whose own loss's temporaries outgrow the backward's."""
    half_working_set_phase: str = "backward"
    """The same under bf16 autocast."""
    flops: float = 0.0
    """Training FLOPs per sample: forward 2, backward 2 (activation gradients) and 2 more for
    each trainable parameter's gradient, x parameters x tokens (6 x parameters x tokens when
    all of them train)."""
    tokens_per_sample: float = 1.0
    fsdp_units: tuple[tuple[int, int], ...] = ()
    """For a model profiled whole (one layer): (parameters, trainable parameters) of each
    entry of its ``nn.ModuleList`` s, the units FSDP shards and gathers on their own."""
    device_type: str = "cpu"
    """The device the model trains on (``cuda`` on a GPU cluster): optimizers choose their
    default implementation by it."""

    @property
    def params(self) -> int:
        """All parameters."""
        return sum(layer.params for layer in self.layers)

    @property
    def trainable(self) -> int:
        """Parameters that train (all but the frozen ones)."""
        return sum(layer.params - layer.frozen for layer in self.layers)

    def carries_gradient(self, index: int) -> bool:
        """Whether layer ``index``'s output has a gradient in backward: some layer up to it
        trains (behind a frozen prefix, such as a LoRA model's embedding, none flows)."""
        return any(layer.params > layer.frozen for layer in self.layers[: index + 1])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Build from ``model_probe.profile_model``'s result (unknown keys are ignored)."""
        known = {f.name for f in fields(LayerProfile)}
        layers = tuple(
            LayerProfile(**{k: v for k, v in row.items() if k in known}) for row in data["layers"]
        )
        return cls(
            layers=layers,
            param_bytes=int(data.get("param_bytes", 4)),
            backward_extra_bytes=float(data.get("backward_extra_bytes", 0.0)),
            backward_fixed_bytes=float(data.get("backward_fixed_bytes", 0.0)),
            half_backward_extra_bytes=float(data.get("half_backward_extra_bytes", 0.0)),
            half_backward_fixed_bytes=float(data.get("half_backward_fixed_bytes", 0.0)),
            working_set_phase=str(data.get("working_set_phase", "backward")),
            half_working_set_phase=str(data.get("half_working_set_phase", "backward")),
            flops=float(data.get("flops", 0.0)),
            tokens_per_sample=float(data.get("tokens_per_sample", 1.0)),
            fsdp_units=tuple((int(p), int(t)) for p, t in data.get("fsdp_units", ())),
            device_type=str(data.get("device_type", "cpu")),
        )
