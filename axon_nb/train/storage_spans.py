"""Which spans of the notebook's memory carry a dataset's arrays, so that views travel as
the storage they view, once, and are rebuilt on the ranks as the same views.

A dataset's tensors are often views of one another (a column ``x[:, :1]``, a slice, a
transpose, ``expand``) or of one storage. Each array (a CPU tensor, or a NumPy array seen as
one) covers a *span* of its storage: from its first element to one past its last. Arrays on
one storage (and of one dtype) are sent as the union of their spans, once, and each is
rebuilt as ``held.as_strided(shape, stride, offset)``: the ranks' views share memory where
the notebook's do. An array that uses under half of its own span (a column of a wide
matrix), or a group whose arrays use under half of their union (two rows far apart), is
sent as its own contiguous copy instead, so a host never holds much more than the bytes
the dataset uses. Example::

    x = torch.randn(1000, 64)
    spans = plan([x, x[:, :1], x.T])
    # [Span(1000*64 elements, members 0 and 2), Span(1000 elements, member 1: a copy)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axon_nb.spec.shared_data import SharedView


@dataclass
class Span:
    """One held tensor: ``tensor`` is what is sent (contiguous, 1-D), ``views`` how each of
    the dataset's arrays (by its index) is made from it, ``arrays`` the notebook's arrays."""

    tensor: Any
    views: dict[int, SharedView] = field(default_factory=dict)
    arrays: list[Any] = field(default_factory=list)
    """The notebook's own arrays (what keeps the span's key while they live unchanged)."""
    layouts: list[tuple[Any, ...]] = field(default_factory=list)
    """Each array's dtype, shape, strides, offset, data pointer and version (see
    ``notebook_data._fingerprint``)."""


def as_tensor(array: Any, torch: Any) -> Any:
    """A tensor viewing ``array`` (a tensor itself, or a NumPy array: ``torch.from_numpy``)."""
    return array if isinstance(array, torch.Tensor) else torch.from_numpy(array)


def plan(arrays: list[Any], torch: Any) -> list[Span]:
    """The spans that carry ``arrays`` (tensors and NumPy arrays), each array in one."""
    views = [as_tensor(a, torch) for a in arrays]
    groups: dict[tuple[int, Any], list[int]] = {}
    alone: list[int] = []
    for i, t in enumerate(views):
        lo, hi = extent(t)
        if 2 * t.numel() < hi - lo:
            alone.append(i)
        else:
            groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    spans = []
    for members in groups.values():
        lo, hi = _union(views, members)
        if len(members) > 1 and 2 * sum(views[i].numel() for i in members) < hi - lo:
            spans += [_span_of(arrays, views, [i]) for i in members]
        else:
            spans.append(_span_of(arrays, views, members))
    for i in alone:
        t = views[i]
        copy = t.contiguous().reshape(-1)
        span = Span(copy, arrays=[arrays[i]], layouts=[layout(t)])
        span.views[i] = SharedView(0, tuple(t.shape), _row_major(t.shape), 0, _is_numpy(arrays[i]))
        spans.append(span)
    return spans


def extent(t: Any) -> tuple[int, int]:
    """``[first, last + 1)``: the elements of ``t``'s storage it reaches."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset(), t.storage_offset() + reach + 1


def layout(t: Any) -> tuple[Any, ...]:
    """What tells another view, or a write torch counted, apart."""
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.data_ptr(),
            t._version)  # fmt: skip


def _union(views: list[Any], members: list[int]) -> tuple[int, int]:
    """The span of storage ``members``' views reach together."""
    return min(extent(views[i])[0] for i in members), max(extent(views[i])[1] for i in members)


def _span_of(arrays: list[Any], views: list[Any], members: list[int]) -> Span:
    lo, hi = _union(views, members)
    first = views[members[0]]
    span = Span(first.as_strided((hi - lo,), (1,), lo))
    for i in members:
        t = views[i]
        span.views[i] = SharedView(0, tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo,
                                   _is_numpy(arrays[i]))  # fmt: skip
        span.arrays.append(arrays[i])
        span.layouts.append(layout(t))
    return span


def _row_major(shape: Any) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_numpy(array: Any) -> bool:
    return type(array).__module__ == "numpy"
