"""Forward only through a pipelined model, one whole batch at a time: evaluation and
prediction under a pipeline layout.

Training goes through ``torch.distributed.pipelining``'s schedules, which split a batch into
a fixed number of micro-batches; an evaluation set's last batch is usually smaller and need
not divide. Here the batch goes stage by stage instead: stage ``s``'s owner (pipeline rank
``s % pp``) receives the activation from stage ``s - 1``'s owner, runs its layers and sends
the result on. Each activation is preceded by a small header (its dtype and shape), so any
batch size passes. Every rank of the pipeline group calls :func:`forward` for every batch;
only the last stage's owner gets the output. Example (what evaluation does)::

    output = forward(piped, batch_inputs)    # a tensor on the last stage, None elsewhere
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from axon_nb.parallel.pipeline import PipelinedModel

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
"""The dtypes an activation may have between stages (a header sends its index here)."""
MAX_DIMS = 6
"""Dimensions an activation may have (the header has room for this many)."""


def forward(model: PipelinedModel, inputs: Any) -> torch.Tensor | None:
    """The whole model's output for ``inputs`` (used on the first stage only) on the last
    stage's owner; None on every other pipeline rank. A collective over the pipeline group."""
    stages = dict(zip(model.stage_indices, model.parts, strict=True))
    group = model.group
    pp = dist.get_world_size(group) if group is not None else 1
    device = next(model.parameters()).device
    activation: torch.Tensor | None = None
    for stage in range(model.num_stages):
        owner, previous = stage % pp, (stage - 1) % pp
        if stage not in stages:
            continue
        if stage == 0:
            activation = inputs.to(device) if isinstance(inputs, torch.Tensor) else inputs
        elif previous != owner:  # (one rank may own two stages in a row only when pp == 1)
            activation = _receive(group, previous, device)
        assert activation is not None
        activation = stages[stage](activation)
        if stage + 1 < model.num_stages and (stage + 1) % pp != owner:
            _send(activation, group, (stage + 1) % pp)
    return activation if model.has_last else None


def _send(tensor: torch.Tensor, group: Any, to: int) -> None:
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise TypeError(
            f"a pipeline stage returned a {tensor.dtype} tensor of {tensor.dim()} dimensions; "
            f"stages may pass on {MAX_DIMS} dimensions at most, of {DTYPES}"
        )
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.send(header, group=group, group_dst=to)
    dist.send(tensor.contiguous(), group=group, group_dst=to)


def _receive(group: Any, source: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=source)
    dtype, dims = DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, group=group, group_src=source)
    return tensor
