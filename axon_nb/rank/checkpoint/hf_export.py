"""A trained model written the way its users load it: ``save_pretrained`` (config and
safetensors) for a transformers model, the adapter alone for a PEFT model.

The full model state is gathered from whatever the strategy sharded (a collective on every
rank), and rank 0 hands it to the model's own ``save_pretrained``, so the directory loads with
``from_pretrained`` / ``PeftModel.from_pretrained`` like any other.
"""

from __future__ import annotations

import os

from axon_nb.rank import runtime
from axon_nb.rank.checkpoint.checkpoint_io import agree, run_named


def save_pretrained(name: str, partial: str) -> int:
    """Write run ``name``'s model into the directory ``partial`` (rank 0; every rank takes
    part in gathering it); returns the step."""
    state = run_named(name, "save")
    ctx = runtime.context()
    module = state.module
    error: Exception | None = None
    save = getattr(module, "save_pretrained", None)  # (transformers' or PEFT's)
    if not callable(save):
        error = TypeError(
            f"format='hf' writes what save_pretrained writes, but the model is a "
            f"{type(module).__name__}, which has no save_pretrained (not a transformers or "
            "PEFT model); save it with format='torch'"
        )
    agree(ctx, error, "save the model with save_pretrained")
    assert callable(save)  # (else every rank raised at agree)
    model_state = state.parallel.get_state(state.optimizer, full=True)["model"]
    if ctx.rank == 0:
        try:
            os.makedirs(partial, exist_ok=True)
            save(partial, state_dict=model_state, safe_serialization=True)
        except Exception as e:
            error = e
    agree(ctx, error, "write the model with save_pretrained")
    return state.step
