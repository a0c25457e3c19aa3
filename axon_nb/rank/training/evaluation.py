"""Evaluating the model a run holds, under the run's own layout: no gradients, ``model.eval()``
(the mode is restored after), every sample of the set counted exactly once.

The data-parallel ranks take every ``dp``-th sample (rank ``i`` of ``dp``: samples ``i, i+dp,
...``), so no sample is padded in twice. A sharded model gathers its parameters in each
forward, so every rank runs as many forwards: a rank with fewer batches runs its last one
again and counts it with weight 0. Tensor-parallel peers read the same samples. The loss and
each metric are summed weighted by the samples of each batch, summed over the data-parallel
ranks and divided by the set's size: the sample-weighted mean over the whole set. Example::

    evaluate_run("model", ds, loss=None, metrics={"acc": accuracy}, batch_size=32)
    # {"loss": 0.41, "acc": 0.87, "samples": 1000}
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.rank import runtime
from axon_nb.rank.data.shards import resolve_dataset
from axon_nb.rank.data.structure import collate, map_tensors
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.model_loss import own_loss


def evaluate_run(
    name: str,
    data: Any,
    *,
    loss: Callable[..., Any] | None,
    metrics: Mapping[str, Callable[..., Any]],
    batch_size: int,
) -> dict[str, float]:
    """The loss and ``metrics`` of run ``name``'s model over ``data`` (every rank calls it)."""
    ctx = runtime.context()
    state = trainstate.get(name)
    parallel = state.parallel
    if parallel.pipeline is not None:
        raise NotImplementedError(
            "evaluate does not run pipeline layouts yet: save the model (cluster.save) and "
            "evaluate it under another strategy"
        )
    coords = parallel.dims.coords(ctx.rank) if dist.is_initialized() else {"dp": 0}
    dp = parallel.dims.dp if dist.is_initialized() else 1
    dataset = resolve_dataset(data, ctx.rank)
    if len(dataset) < dp:  # (every rank sees it: none is left waiting in a collective)
        raise ValueError(
            f"the evaluation set has {len(dataset)} samples, fewer than the {dp} data-parallel "
            "ranks that split it; evaluate a set with at least one sample per rank"
        )
    mine = list(range(coords["dp"], len(dataset), dp))
    rounds = math.ceil(math.ceil(len(dataset) / dp) / batch_size)  # rank 0 has the most
    sums = torch.zeros(2 + len(metrics), dtype=torch.float64)  # samples, loss, metrics...
    with _eval_mode(parallel.model), torch.no_grad():
        for indices, weight in _rounds(mine, batch_size, rounds):
            batch = map_tensors(lambda t: t.to(ctx.device), collate([dataset[i] for i in indices]))
            output, target = _forward(parallel.model, batch, loss)
            values = [_loss(output, target, batch, loss)]
            values += [_scalar(fn(output, target), key) for key, fn in metrics.items()]
            count = len(indices) * weight
            sums[0] += count
            sums[1:] += torch.tensor([float(v) * count for v in values], dtype=torch.float64)
    if dist.is_initialized() and dp > 1:
        group = parallel.dp_group
        dist.all_reduce(sums, group=group)
    total = float(sums[0])
    result = {"loss": float(sums[1]) / total}
    result |= {key: float(sums[2 + i]) / total for i, key in enumerate(metrics)}
    return {**result, "samples": round(total)}


def _rounds(mine: list[int], batch_size: int, rounds: int) -> Iterator[tuple[list[int], int]]:
    """``rounds`` batches of this rank's samples, each with its weight: 1, or 0 for a repeat
    of the last batch run only so that every rank runs as many forwards."""
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    for r in range(rounds):
        yield (batches[r], 1) if r < len(batches) else (batches[-1], 0)


def _forward(model: nn.Module, batch: Any, loss: Callable[..., Any] | None) -> tuple[Any, Any]:
    """``(output, what loss and metrics compare it with)``: the target of a pair, else the
    batch itself (a Mapping's labels are in it)."""
    if isinstance(batch, Mapping):
        return model(**batch), batch
    if isinstance(batch, tuple | list) and len(batch) == 2 and not hasattr(batch, "_fields"):
        inputs, target = batch
        if loss is None:
            raise ValueError(
                "evaluating (input, target) pairs needs loss=loss(output, target); the model's "
                "own loss is taken from Mapping batches (model(**batch).loss)"
            )
        return model(inputs), target
    return model(batch), batch


def _loss(output: Any, target: Any, batch: Any, loss: Callable[..., Any] | None) -> torch.Tensor:
    value = own_loss(output, batch) if loss is None else loss(output, target)
    return _scalar(value, "loss")


def _scalar(value: Any, key: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ValueError(
            f"{key} must return a scalar (a batch's mean); it returned shape {tuple(tensor.shape)}"
        )
    return tensor.detach().float().reshape(())


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside, each module's own mode back after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)
