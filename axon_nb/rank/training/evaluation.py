"""Evaluating the model a run holds, under the run's own layout: no gradients, ``model.eval()``
(the mode is restored after), every sample of the set counted exactly once.

The data-parallel ranks take every ``dp``-th sample (rank ``i`` of ``dp``: samples ``i, i+dp,
...``), so no sample is padded in twice. A sharded model gathers its parameters in each
forward, so every rank runs as many forwards: a rank with fewer batches runs its last one
again and counts it with weight 0. Tensor-parallel peers read the same samples. The loss and
each metric are summed weighted by the samples of each batch, summed over the data-parallel
ranks and divided by the set's size: the sample-weighted mean over the whole set. A
pipeline runs each batch forward only, stage to stage (``parallel/pipeline_forward.py``); its
last stage computes the sums and sends them to the earlier ones. Example::

    evaluate_run("model", ds, loss=None, metrics={"acc": accuracy}, batch_size=32)
    # {"loss": 0.41, "acc": 0.87, "samples": 1000}
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.parallel import pipeline_forward
from axon_nb.parallel.parallelize import ParallelModel
from axon_nb.rank import runtime
from axon_nb.rank.data.shards import resolve_dataset
from axon_nb.rank.data.structure import collate, map_tensors
from axon_nb.rank.observe.call_progress import reported
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
    dataset = resolve_dataset(data, ctx.rank)
    return evaluate_model(
        state.parallel,
        dataset,
        loss=loss,
        metrics=metrics,
        batch_size=batch_size,
        ctx=ctx,
        report=True,
    )


def evaluate_model(
    parallel: ParallelModel,
    dataset: Any,
    *,
    loss: Callable[..., Any] | None,
    metrics: Mapping[str, Callable[..., Any]],
    batch_size: int,
    ctx: runtime.RankContext,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    max_batches: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    report: bool = False,
) -> dict[str, float]:
    """The loss and ``metrics`` of a laid-out model over ``dataset`` (every rank calls it),
    ``batch_size`` samples per forward on each data-parallel rank. ``max_batches``: stop
    after that many (a check of the first batch before a run trains). ``collate_fn``: how
    items become a batch (the run's ``loader={"collate_fn": ...}``, e.g. padding); default
    PyTorch's, lists of numbers made tensors. ``report``: publish the progress to the
    kernel (``rank/observe/call_progress.py``)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    mine, rounds = share_of(parallel, len(dataset), batch_size, ctx.rank, "evaluate")
    rounds = min(rounds, max_batches or rounds)
    sums = torch.zeros(2 + len(metrics), dtype=torch.float64)  # samples, loss, metrics...
    error: Exception | None = None
    try:
        with eval_mode(parallel.model), torch.no_grad():
            batches: Iterable[tuple[list[int], int]] = rounds_of(mine, batch_size, rounds)
            if report:
                batches = reported(batches, rounds, lambda: _mean_loss(sums))
            for indices, weight in batches:
                items = [dataset[i] for i in indices]
                batch = (collate_fn or collate)(items)
                batch = map_tensors(lambda t: t.to(ctx.device), batch)
                with autocast():
                    values = _batch_values(parallel, batch, loss, metrics)
                if values is not None:  # (None: not the pipeline's last stage)
                    count = len(indices) * weight
                    sums[0] += count
                    sums[1:] += torch.tensor([v * count for v in values], dtype=torch.float64)
    except Exception as e:  # a metric's failure is agreed on before the sums are
        error = e
    if distributed:
        _agree(error, ctx)
        sums = _combine(sums, parallel, ctx.device)
    elif error is not None:
        raise error
    total = float(sums[0])
    result = {"loss": float(sums[1]) / total}
    result |= {key: float(sums[2 + i]) / total for i, key in enumerate(metrics)}
    return {**result, "samples": round(total)}


def _mean_loss(sums: torch.Tensor) -> float | None:
    """The mean loss of this rank's batches so far (None before any)."""
    return float(sums[1] / sums[0]) if float(sums[0]) else None


def _batch_values(
    parallel: ParallelModel,
    batch: Any,
    loss: Callable[..., Any] | None,
    metrics: Mapping[str, Callable[..., Any]],
) -> list[float] | None:
    """The batch's loss and metrics (batch means); None on a pipeline's earlier stages."""
    piped = parallel.pipeline
    if piped is None:
        output, target = _forward(parallel.model, batch, loss, bool(metrics))
    else:
        inputs, target = piped.pair(batch, loss)
        output = pipeline_forward.forward(piped, inputs)
        if output is None:
            return None
    if piped is not None:
        value = piped.loss(output, target, loss)
    elif output is None:  # model(input, target) returned the loss itself
        value = target
    else:
        value = own_loss(output, batch) if loss is None else loss(output, target)
    values = [_scalar(value, "loss")]
    if piped is not None and isinstance(batch, Mapping):
        target = batch  # metrics see a Mapping batch whole, as without a pipeline
    values += [_scalar(fn(output, target), f"metric {key!r}") for key, fn in metrics.items()]
    return [float(v) for v in values]


def _agree(error: Exception | None, ctx: runtime.RankContext) -> None:
    """Raise on every rank when evaluating failed on any (the failing rank raises its own)."""
    flags = torch.zeros(ctx.world_size, device=ctx.device)
    flags[ctx.rank] = float(error is not None)
    dist.all_reduce(flags)
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failed:
        raise PeerEvalFailed(failed)


class PeerEvalFailed(RuntimeError):
    """Evaluating failed on other ranks (``ranks``); they raise their own error."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"evaluation failed on rank(s) {ranks}: see their error")
        self.ranks = ranks


def _combine(sums: torch.Tensor, parallel: ParallelModel, device: torch.device) -> torch.Tensor:
    """The sums over the data-parallel ranks, on every rank (a pipeline's last stage holds
    them and sends them to its earlier stages)."""
    sums = sums.to(device)
    if parallel.dims.dp > 1:
        dist.all_reduce(sums, group=parallel.dp_group)
    piped = parallel.pipeline
    if piped is not None and piped.group is not None:
        last = dist.get_world_size(piped.group) - 1
        dist.broadcast(sums, group=piped.group, group_src=last)
    return sums.cpu()


def share_of(
    parallel: ParallelModel, size: int, batch_size: int, rank: int, verb: str
) -> tuple[list[int], int]:
    """This rank's sample indices of a set of ``size`` (data-parallel rank ``i`` of ``dp``
    takes ``i, i + dp, ...``) and the forwards every rank runs (rank 0 has the most samples).
    ``ValueError`` on every rank (none is left waiting in a collective) when the set has
    fewer samples than ranks; ``verb`` says what the user was doing."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    index, dp = parallel.dims.data_rank(rank) if distributed else (0, 1)
    if size < dp:
        raise ValueError(
            f"the data has {size} samples, fewer than the {dp} data-parallel ranks that split "
            f"it; {verb} at least one sample per rank"
        )
    return list(range(index, size, dp)), math.ceil(math.ceil(size / dp) / batch_size)


def rounds_of(mine: list[int], batch_size: int, rounds: int) -> Iterator[tuple[list[int], int]]:
    """``rounds`` batches of this rank's samples, each with its weight: 1, or 0 for a repeat
    of the last batch run only so that every rank runs as many forwards."""
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    for r in range(rounds):
        yield (batches[r], 1) if r < len(batches) else (batches[-1], 0)


def _forward(
    model: nn.Module, batch: Any, loss: Callable[..., Any] | None, metrics: bool
) -> tuple[Any, Any]:
    """``(output, what loss and metrics compare it with)``: the target of a pair, else the
    batch itself (a Mapping's labels are in it). A pair without ``loss`` is evaluated as it
    trains, ``model(input, target)`` returning the loss: ``(None, loss)``."""
    if isinstance(batch, Mapping):
        return model(**batch), batch
    if isinstance(batch, tuple | list) and len(batch) == 2 and not hasattr(batch, "_fields"):
        inputs, target = batch
        if loss is None:
            if metrics:
                raise ValueError(
                    "metrics compare the model's output with the target, but with loss=None "
                    "an (input, target) pair runs model(input, target), which returns only "
                    "the loss: pass loss=loss(output, target) to evaluate metrics"
                )
            try:
                return None, model(inputs, target)
            except TypeError as e:  # its forward takes the input only
                raise ValueError(
                    "with loss=None an (input, target) pair is evaluated as model(input, "
                    f"target), which raised TypeError: {e}; this model needs loss=loss(output, "
                    "target)"
                ) from e
        return model(inputs), target
    return model(batch), batch


def _scalar(value: Any, key: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ValueError(
            f"{key} must return a scalar (a batch's mean); it returned shape {tuple(tensor.shape)}"
        )
    return tensor.detach().float().reshape(())


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside, each module's own mode back after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)
