"""What an optimizer keeps (its state) and what its step allocates and frees (temporaries), per
PyTorch's implementation paths, measured on torch 2.13 (``benchmarks/memory_zoo.py`` prints
them beside the rest of each peak).

==========================  ================  =========================================
optimizer                   state per param   step temporaries
==========================  ================  =========================================
SGD                         0                 0 (weight decay: the largest tensor)
SGD, momentum               4 bytes           the same
Adam, AdamW (for-loop)      8 bytes           2 x the largest tensor (the square root of
                                              the second moment and its quotient); Adam
                                              with weight decay one more (the decayed
                                              gradient); AdamW decays in place
Adam, AdamW (``foreach``)   8 bytes           every tensor once (the square roots, as one
                                              list)
Adam, AdamW (``fused``)     8 bytes           none
``amsgrad=True``            4 bytes more
Adagrad, RMSprop            4 bytes           2 x the largest tensor
==========================  ================  =========================================

PyTorch's default path is ``foreach`` when every parameter is on a GPU and the for-loop on a
CPU. "Tensor" means what the optimizer steps: a parameter, its shard (FSDP) or ZeRO-2's
bucket slice. Example::

    step_temporaries(("adamw", {"lr": 1e-3}), largest=4e6, total=4e8, device_type="cuda")
"""

from __future__ import annotations

from typing import Any

OPTIMIZER_STATE_BYTES = {
    "adam": 8, "adamw": 8, "adamax": 8, "nadam": 8, "radam": 8,  # two moments
    "adagrad": 4, "rmsprop": 4, "sgd": 0,  # one sum or average; SGD: none without momentum
}  # fmt: skip
"""Optimizer state bytes per fp32 parameter, by ``train``'s optimizer names."""
_ADAM = {"adam", "adamw", "adamax", "nadam", "radam"}


def parse(optimizer: Any) -> tuple[str, dict[str, Any]]:
    """``(name, kwargs)`` of ``optimizer`` as ``train`` takes it (a callable counts as
    ``adamw`` with PyTorch's defaults); ``ValueError`` for a name with no known sizes."""
    if callable(optimizer):
        return "adamw", {}
    name, kwargs = (optimizer, {}) if isinstance(optimizer, str) else optimizer
    if name.lower() not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"no optimizer-state size for optimizer {name!r}; use one of "
            f"{', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    return name.lower(), dict(kwargs or {})


def state_bytes(optimizer: Any) -> int:
    """Optimizer state bytes per parameter for ``optimizer`` (a name, ``(name, kwargs)`` or a
    callable: counted as Adam)."""
    name, kwargs = parse(optimizer)
    extra = 4 if name in ("sgd", "rmsprop") and kwargs.get("momentum") else 0
    if name in _ADAM and kwargs.get("amsgrad"):
        extra += 4
    return OPTIMIZER_STATE_BYTES[name] + extra


def step_temporaries(optimizer: Any, *, largest: float, total: float, device_type: str) -> float:
    """Bytes the optimizer's step allocates at most at once beyond its state, for tensors of
    ``total`` bytes whose largest has ``largest`` (see the module docstring)."""
    name, kwargs = parse(optimizer)
    if kwargs.get("fused"):
        return 0.0
    foreach = kwargs.get("foreach")
    if foreach is None:
        foreach = device_type == "cuda"
    decay = bool(kwargs.get("weight_decay")) and name != "adamw"
    if name == "sgd":
        return (total if foreach else largest) if decay else 0.0
    if foreach:
        return total * (2 if decay else 1)
    return largest * (3 if decay else 2)
