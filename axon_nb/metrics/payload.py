"""What a collective call carries: which ``torch.distributed`` (and functional) collectives are
measured, under which kind, and how many payload bytes this rank hands to one call."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

KINDS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "isend": "send_recv",
    "irecv": "send_recv",
}
"""Wrapped ``torch.distributed`` functions -> collective kind reported in the stream."""

PAYLOAD: dict[str, str] = {
    "all_reduce": "tensor",
    "all_gather": "tensor",  # (tensor_list is the output)
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",  # FSDP2 passes it by keyword
    "broadcast": "tensor",
    "all_to_all_single": "input",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
"""The parameter of each wrapped function that holds this rank's payload, found by binding
the call to the function's signature, so positional and keyword calls count alike."""

FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
"""Wrapped functional collectives (``torch.distributed._functional_collectives``) -> kind;
their payload is their first parameter, ``self``."""


class Payload:
    """Reads this rank's payload bytes from a call of ``torch.distributed.<name>``.

    Example::

        Payload("reduce_scatter_tensor", dist.reduce_scatter_tensor).nbytes((), {"output": out,
                                                                                 "input": x})
    """

    def __init__(self, name: str, fn: Callable[..., Any], parameter: str | None = None) -> None:
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one: positions of the default API
            self.signature = None
        params = self.signature.parameters if self.signature is not None else {}
        self.parameter = (
            parameter or PAYLOAD.get(name) or ("tensor" if "tensor" in params else None)
        )
        self.position = _DEFAULT_POSITIONS.get(self.parameter or "", 0)

    def nbytes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if self.parameter is None:
            return 0
        if self.signature is not None:
            try:
                bound = self.signature.bind_partial(*args, **kwargs)
            except TypeError:
                return 0
            return _nbytes(bound.arguments.get(self.parameter))
        if self.parameter in kwargs:
            return _nbytes(kwargs[self.parameter])
        return _nbytes(args[self.position]) if len(args) > self.position else 0


_DEFAULT_POSITIONS = {"self": 0, "tensor": 0, "input_tensor": 1, "input": 1, "input_list": 1}


def _nbytes(value: Any) -> int:
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    numel = getattr(value, "numel", None)
    return int(numel() * value.element_size()) if numel is not None else 0
