"""The communication probe reads each collective's payload by binding the call to the
function's signature: positional and keyword calls (FSDP2 passes ``input=``) count alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from axon_nb.metrics.comm import KINDS, Payload

SHARD, FULL = torch.ones(5), torch.ones(10)  # 20 and 40 bytes


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "expected"),
    [
        ("reduce_scatter_tensor", (SHARD, FULL), {}, 40),
        ("reduce_scatter_tensor", (), {"output": SHARD, "input": FULL}, 40),  # FSDP2's call
        ("reduce_scatter_single", (SHARD,), {"input": FULL, "async_op": True}, 40),
        ("reduce_scatter", (SHARD, [SHARD, SHARD]), {}, 40),
        ("all_gather_into_tensor", (FULL, SHARD), {}, 20),
        ("all_gather_into_tensor", (), {"output_tensor": FULL, "input_tensor": SHARD}, 20),
        ("all_gather", ([SHARD, SHARD], SHARD), {}, 20),
        ("all_gather", (), {"tensor_list": [SHARD, SHARD], "tensor": SHARD}, 20),
        ("all_reduce", (FULL,), {"async_op": True}, 40),
        ("all_reduce", (), {"tensor": FULL}, 40),
        ("all_to_all_single", (FULL, FULL), {}, 40),
        ("broadcast", (FULL, 0), {}, 40),
        ("send", (), {"tensor": SHARD, "dst": 1}, 20),
    ],
)
def test_payload_bytes_of_every_calling_convention(
    name: str, args: tuple, kwargs: dict, expected: int
) -> None:
    assert Payload(name, getattr(dist, name)).nbytes(args, kwargs) == expected


def test_every_wrapped_function_has_a_payload_parameter_in_its_signature() -> None:
    import inspect

    for name in KINDS:
        payload = Payload(name, getattr(dist, name))
        assert payload.parameter in inspect.signature(getattr(dist, name)).parameters, name
