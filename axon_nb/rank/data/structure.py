"""Batches of any structure: tensors inside tuples, lists, named tuples, mappings (``dict``,
transformers' ``BatchEncoding`` and other ``UserDict``\\ s), dataclasses, nested; anything else
(strings, ids, ``None``) passes through untouched.

Example::

    batch = {"input_ids": ids, "labels": labels, "source": ["a.txt", "b.txt"]}
    on_gpu = map_tensors(lambda t: t.to("cuda"), batch)  # a dict again, strings kept
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` rebuilt with ``fn(t)`` in place of every tensor ``t``, of the same types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _same_mapping(batch, {k: map_tensors(fn, v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(fn, v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: map_tensors(fn, getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, depth first."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return iter(found)


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """``items`` as ``type(original)`` where that type can be built from a dict (``dict``,
    ``OrderedDict``, ``UserDict``, ``BatchEncoding``), else as a plain ``dict``."""
    kind: Any = type(original)  # (a Mapping's constructor takes what its class says)
    if kind is dict:
        return items
    try:
        return kind(items)
    except TypeError:  # e.g. a defaultdict, whose first argument is its factory
        return items


def collate(items: list[Any]) -> Any:
    """PyTorch's ``default_collate`` after turning lists of numbers into tensors, so items
    of a Hugging Face ``datasets.Dataset`` without ``set_format("torch")`` (``input_ids`` as a
    list of ints) stack into ``[batch, length]`` tensors instead of ``length`` tensors of
    ``[batch]``."""
    return default_collate([_lists_as_tensors(item) for item in items])


def _lists_as_tensors(item: Any) -> Any:
    if isinstance(item, list) and item and _numbers(item):
        return torch.tensor(item)
    if isinstance(item, Mapping):
        return _same_mapping(item, {k: _lists_as_tensors(v) for k, v in item.items()})
    return item


def _numbers(values: list[Any]) -> bool:
    """True for a (nested) list of ints, floats and bools."""
    if isinstance(values[0], list):
        return all(isinstance(v, list) and v and _numbers(v) for v in values)
    return all(isinstance(v, int | float | bool) for v in values)
