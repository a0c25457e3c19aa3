"""Extra passes of the model probe: the same forward and backward at a smaller batch and under
bf16 autocast, so that what grows with the samples is told from what does not (a stacked
experts weight's gradient pieces, autocast's bf16 copies of the weights) and 16-bit
activations are measured, not assumed to be half of the fp32 ones.

Example (what ``model_probe.profile_model`` does)::

    saved, peak, phase = measure_pass(model, layers, inputs, target, loss_fn,
                                      forward=_forward, dtype=torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from axon_nb.metrics.peak import PeakTracker, mark_phase


def measure_pass(
    model: nn.Module,
    layers: list[nn.Module],
    inputs: Any,
    target: Any,
    loss_fn: Any,
    *,
    forward: Callable[..., torch.Tensor],
    dtype: torch.dtype | None = None,
    hooks: Sequence[Any] = (),
) -> tuple[list[int], int, str]:
    """Bytes autograd saves for backward in each of ``layers`` (a tensor two layers save is
    counted once, by the first; the parameters are not), the peak of one forward (under
    autocast to ``dtype`` when given) and backward, leaving the parameter gradients out, and
    the phase it came in (``forward``: a model that computes its own loss may peak there).
    ``hooks``: the caller's recording hooks on the model, removed with this pass's own.
    Parameter gradients are labelled as autograd accumulates them, so the peak leaves them
    out; the parameters themselves are no new storage to the tracker."""
    saved, current, pack = saved_counter(model, len(layers))
    tracker = PeakTracker()

    def accumulated(param: nn.Parameter) -> None:
        tracker.label(param.grad, "grads")

    hooks = [*hooks, *(p.register_post_accumulate_grad_hook(accumulated)
                       for p in model.parameters() if p.requires_grad)]  # fmt: skip
    hooks += [
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        for i, layer in enumerate(layers)
    ]
    device = next((p.device.type for p in model.parameters()), "cpu")
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mark_phase("forward")
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = forward(model, layers, inputs, target, loss_fn)
            mark_phase("backward")
            loss.float().sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    peak, phase = tracker.moment_excluding("grads")
    tracker.close()
    return saved, peak, phase


def saved_counter(
    model: nn.Module, layers: int
) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
    """``(saved, current, pack)``: a saved-tensors pack hook that adds each storage autograd
    saves to ``saved[current[0]]`` (the layer running: set ``current[0]`` from a forward
    pre-hook), once (a tensor two layers save, a ReLU's output and the next convolution's
    input, counts in the first), leaving the parameters out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, current = [0] * layers, [0]
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen and storage.nbytes():
            seen.add(ptr)
            saved[current[0]] += storage.nbytes()
        return t

    return saved, current, pack


def split_fixed(full: float, small: float, samples: int, fewer: int) -> tuple[float, float]:
    """(per sample, fixed) of a quantity measured as ``full`` at ``samples`` and ``small`` at
    ``fewer`` samples, neither negative."""
    per_sample = max(0.0, (full - small) / (samples - fewer))
    return per_sample, max(0.0, full - per_sample * samples)


def head(value: Any, n: int) -> Any:
    """The first ``n`` samples of a batch part (a tensor, a mapping or a sequence of them)."""
    from collections.abc import Mapping

    if isinstance(value, torch.Tensor):
        return value[:n]
    if isinstance(value, Mapping):
        return {k: head(v, n) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(head(v, n) for v in value)
    return value
