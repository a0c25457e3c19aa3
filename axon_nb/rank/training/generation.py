"""Text generation with a transformers causal LM that a run holds (``cluster.generate``),
under its own layout: every rank runs the model's own ``generate`` on the same prompts, so a
sharded (FSDP) or tensor-parallel model gathers what each forward needs, and rank 0 returns
the tokens. Every rank samples with one seed, so all take the same tokens and stop together;
the ranks' random state is restored afterwards (a resumed run is not changed by it).
Example::

    generate_run("model", ids, attention_mask=None, seed=0, max_new_tokens=20,
                 options={"do_sample": False})   # [batch, prompt + 20] on rank 0
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from axon_nb.rank import runtime
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.evaluation import eval_mode


def generate_run(
    name: str,
    input_ids: Any,
    *,
    attention_mask: Any,
    seed: int,
    max_new_tokens: int,
    options: dict[str, Any],
) -> torch.Tensor | None:
    """The prompts ``input_ids`` continued by run ``name``'s model (rank 0; None elsewhere)."""
    ctx = runtime.context()
    state = trainstate.get(name)
    module = state.module
    generate = getattr(module, "generate", None)
    if not callable(generate):
        raise TypeError(
            f"{name!r} is a {type(module).__name__}, which has no generate(): generate runs "
            "transformers causal LMs (e.g. LlamaForCausalLM); call cluster.predict for other "
            "models' outputs"
        )
    if state.parallel.pipeline is not None:
        raise NotImplementedError(
            "generate does not run pipeline layouts: save the model (cluster.save) and load "
            "it under DDP, FSDP or TensorParallel to generate"
        )
    _gather_around_generate(module)
    generate = getattr(module, "generate", generate)  # again: FSDP has just wrapped it
    ids = torch.as_tensor(input_ids).to(ctx.device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    kwargs = dict(options)
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(attention_mask).to(ctx.device)
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), eval_mode(module), torch.no_grad():
        torch.manual_seed(seed)
        tokens = generate(input_ids=ids, max_new_tokens=max_new_tokens, **kwargs)
    sequences = getattr(tokens, "sequences", tokens)  # return_dict_in_generate=True
    first = not dist.is_initialized() or dist.get_rank() == 0
    return sequences.cpu() if first else None


def _gather_around_generate(module: torch.nn.Module) -> None:
    """Make FSDP gather the root's own parameters (embeddings, head) around ``generate``, as
    around ``forward``: a PEFT model's ``generate`` calls its base model's, never its own
    forward, so FSDP would not gather them. Once per module; a no-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(module, FSDPModule) and module not in _GATHERING:
        register_fsdp_forward_method(module, "generate")
        _GATHERING.add(module)


_GATHERING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Modules whose ``generate`` FSDP gathers around already (registered once each)."""
