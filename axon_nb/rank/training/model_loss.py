"""How one micro-batch becomes a loss, for the batch shapes users bring.

- ``(input, target)`` pairs: ``loss(model(input), target)``, or with ``loss=None``
  ``model(input, target)`` returns the loss.
- Mappings (``{"input_ids", "attention_mask", "labels"}``, a ``BatchEncoding``): the model
  is called as ``model(**batch)``; with ``loss=None`` its own loss is taken from the output
  (``out.loss``, ``out["loss"]`` or ``out[0]``), else ``loss(output, batch)``.
- Other tuples and lists are refused (a 1-tuple usually means a dataset without targets).
- Anything else (a tensor, a named tuple, a dataclass): ``model(batch)``, then the output's
  own loss or ``loss(output, batch)``.

With ``loss_normalization="tokens"`` a step's loss is the mean over every target token of the
global batch whose label is not ``-100`` (:func:`count_targets`). A Hugging Face model that
takes loss keyword arguments gets that count as ``num_items_in_batch`` and returns its
micro-batch's share of the mean; another loss's micro-batch mean is weighted by its count.

Example::

    rule = LossRule(loss_fn=None, model=model)
    loss = rule.forward(model, {"input_ids": ids, "labels": ids})  # model(**batch).loss
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100
"""Label value that no loss counts (padding, prompt tokens): PyTorch's and transformers'."""


class LossRule:
    """The loss of a micro-batch for one run: the user's ``loss_fn`` or the model's own."""

    def __init__(self, loss_fn: Callable[..., Any] | None, model: nn.Module) -> None:
        self.loss_fn = loss_fn
        self.passes_count = loss_fn is None and _accepts_loss_kwargs(model)
        """The model divides its summed loss by ``num_items_in_batch`` itself."""
        self.shifts_labels = _shifts_labels(model)
        """A causal LM: position 0's label is never a target, so it is not counted."""

    def forward(
        self, model: nn.Module, batch: Any, num_items: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's loss: its mean, or with ``num_items`` (token normalization) its
        summed token losses divided by ``num_items``."""
        if isinstance(batch, Mapping):
            passed = num_items is not None and self.passes_count  # the model divides by it
            extra = {"num_items_in_batch": num_items} if passed else {}
            output = model(**batch, **extra)
            loss = own_loss(output, batch) if self.loss_fn is None else self.loss_fn(output, batch)
            if num_items is not None and not passed:  # a mean: weighted by its share
                loss = loss * count_targets(batch, self.shifts_labels) / num_items
            return _scalar(loss)
        if isinstance(batch, tuple | list) and not hasattr(batch, "_fields"):
            if len(batch) != 2:
                raise TypeError(
                    "each data item must be an (input, target) pair, a Mapping (trained as "
                    "model(**batch)) or one object (model(batch)); a batch came as "
                    f"{type(batch).__name__} of length {len(batch)}"
                )
            inputs, target = batch
            if self.loss_fn is None:
                loss = model(inputs, target)
            else:
                loss = self.loss_fn(model(inputs), target)
        else:
            output = model(batch)
            loss = own_loss(output, batch) if self.loss_fn is None else self.loss_fn(output, batch)
        if num_items is not None:
            loss = loss * count_targets(batch, False) / num_items
        return _scalar(loss)


def own_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss a model returned itself: ``output.loss``, ``output["loss"]``, the first element
    of a tuple, or ``output`` when it is a scalar tensor."""
    found = getattr(output, "loss", None)
    if found is None and isinstance(output, Mapping):
        found = output.get("loss")
    if found is None and isinstance(output, tuple | list) and output:
        first = output[0]
        found = first if isinstance(first, torch.Tensor) and first.numel() == 1 else None
    if found is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        found = output
    if found is not None:
        return found
    what = type(output).__name__
    if isinstance(output, Mapping):
        what += f" with keys {sorted(map(str, output.keys()))}"
    elif isinstance(output, torch.Tensor):
        what += f" of shape {tuple(output.shape)}"
    hint = "pass loss=fn(output, batch) to compute it"
    if isinstance(batch, Mapping) and "labels" not in batch:
        hint = (
            f"the batch has no 'labels' key (it has {sorted(map(str, batch.keys()))}), so the "
            f"model computed no loss: add labels to each item, or {hint}"
        )
    raise TypeError(f"loss=None takes the model's own loss, but the model returned {what} "
                    f"and no loss; {hint}")  # fmt: skip


def count_targets(batch: Any, shifts_labels: bool) -> torch.Tensor:
    """How many of ``batch``'s labels are targets (not :data:`IGNORE_INDEX`): its ``labels``
    (Mapping) or the target of an ``(input, target)`` pair; a causal LM's first position is no
    target. An ``int64`` tensor on the labels' device."""
    if isinstance(batch, Mapping):
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch.get("labels")
            if labels is not None and shifts_labels:
                labels = labels[..., 1:]
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        labels = batch[1]
    else:
        labels = None
    if not isinstance(labels, torch.Tensor):
        raise TypeError(
            "loss_normalization='tokens' counts the labels that are not -100, but this batch "
            f"has none ({type(batch).__name__}): give each item 'labels' (or an (input, target) "
            "pair), or use loss_normalization='mean'"
        )
    return (labels != IGNORE_INDEX).sum()


def _scalar(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise TypeError(
            f"the loss must be a scalar tensor, got {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss.float().reshape(())


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model, possibly in a PEFT wrapper) takes
    ``num_items_in_batch``: its ``accepts_loss_kwargs`` when it says, else whether its forward
    takes ``**kwargs`` (transformers' own rule) and it is a transformers model."""
    inner = _unwrapped(model)
    said = getattr(inner, "accepts_loss_kwargs", None)
    if said is not None:
        return bool(said)
    if not hasattr(inner, "loss_function"):  # not a transformers model
        return False
    params = inspect.signature(inner.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def _shifts_labels(model: nn.Module) -> bool:
    """A decoder-only causal LM, whose loss compares position ``i`` with label ``i + 1``."""
    inner = _unwrapped(model)
    config = getattr(inner, "config", None)
    causal = getattr(inner, "loss_type", None) == "ForCausalLM"
    return causal and not getattr(config, "is_encoder_decoder", False)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel.get_base_model()``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
