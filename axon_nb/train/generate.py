"""``cluster.generate``: text from a transformers causal LM that the ranks hold, under its own
strategy (``axon_nb.rank.training.generation``). Example::

    ids = tokenizer(["The capital of France is"], return_tensors="pt").input_ids
    out = cluster.generate(ids, max_new_tokens=20)            # greedy
    tokenizer.batch_decode(out, skip_special_tokens=True)
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from axon_nb.rank import entry

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike


def generate(
    cluster: ClusterLike,
    input_ids: Any,
    *,
    max_new_tokens: int,
    attention_mask: Any = None,
    seed: int | None = None,
    name: str = "model",
    generate_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The prompts ``input_ids`` (a ``[batch, length]`` or ``[length]`` tensor or list of
    token ids) continued by ``max_new_tokens`` tokens at most, with the model's own
    ``generate`` (greedy unless ``do_sample=True`` is in ``generate_kwargs``), as a CPU
    tensor ``[batch, length + new]``. For DDP, FSDP and tensor-parallel runs: the tokens equal
    the single-process model's ``generate`` on the same weights. ``seed``: every rank samples
    with it (None: a new one each call), so a sampled output is reproducible with a seed.
    """
    problems = []
    whole = isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
    if not whole or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        problems.append(f"seed must be an integer or None, got {seed!r}")
    if input_ids is None or (hasattr(input_ids, "__len__") and len(input_ids) == 0):
        problems.append("input_ids is required: the prompts' token ids (tokenizer(...).input_ids)")
    options = dict(generate_kwargs or {})
    taken = sorted({"input_ids", "attention_mask", "max_new_tokens"} & options.keys())
    if taken:
        problems.append(f"pass {taken} as generate's own arguments, not in generate_kwargs")
    if problems:
        raise ValueError("; ".join(problems))
    seed = random.randrange(2**31) if seed is None else seed
    return cluster.run(
        entry.generate, name, input_ids, attention_mask, seed, max_new_tokens, options
    )[0]
