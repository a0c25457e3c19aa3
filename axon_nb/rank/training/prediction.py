"""The model a run holds, run forward over a data set under its own layout: the outputs of
every item, in data order (``cluster.predict``).

Samples are split over the data-parallel ranks as evaluation splits them (rank ``i`` of
``dp`` takes ``i, i + dp, ...``; a rank with fewer batches repeats its last one, unused, so a
sharded model runs as many forwards everywhere). The ranks whose outputs count are the
first tensor-parallel peer on the last pipeline stage of each data-parallel replica. Each
keeps its rows on the CPU and sends them to rank 0, which interleaves them back into data
order: the kernel receives one copy. With ``output_dir`` each of those ranks writes its rows
to a file instead and only the paths come back. Example::

    predict_run("model", test_ds, batch_size=32)   # logits [len(test_ds), classes]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist

from axon_nb.parallel import pipeline_forward
from axon_nb.parallel.parallelize import ParallelModel
from axon_nb.parallel.pipeline_plan import first_input_name
from axon_nb.rank import runtime
from axon_nb.rank.data.shards import resolve_dataset
from axon_nb.rank.data.structure import collate, map_tensors
from axon_nb.rank.observe.call_progress import reported
from axon_nb.rank.training import trainstate
from axon_nb.rank.training.evaluation import eval_mode, rounds_of, share_of


def predict_run(name: str, data: Any, *, batch_size: int, output_dir: str | None) -> Any:
    """Run ``name``'s model over ``data`` (every rank calls it); rank 0 returns the outputs
    in data order (or, with ``output_dir``, the files written), the others None."""
    ctx = runtime.context()
    parallel = trainstate.get(name).parallel
    dataset = resolve_dataset(data, ctx.rank)
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"predict reads a map-style dataset (with __len__ and __getitem__); got "
            f"{type(dataset).__name__}, which has no length"
        )
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    index, dp = parallel.dims.data_rank(ctx.rank) if distributed else (0, 1)
    coords = parallel.dims.coords(ctx.rank) if distributed else {"tp": 0, "pp": 0}
    counts = coords["tp"] == 0 and coords["pp"] == parallel.dims.pp - 1
    mine, rounds = share_of(parallel, len(dataset), batch_size, ctx.rank, "predict")
    pieces = []
    with eval_mode(parallel.model), torch.no_grad():
        for indices, weight in reported(rounds_of(mine, batch_size, rounds), rounds):
            batch = map_tensors(lambda t: t.to(ctx.device), collate([dataset[i] for i in indices]))
            output = _output(parallel, batch)
            if weight and counts and output is not None:
                pieces.append(map_tensors(lambda t: t.detach().cpu(), _tensors_only(output)))
    rows = concat(pieces) if counts else None
    if output_dir is not None:
        path = None
        if counts:
            path = os.path.join(output_dir, f"predictions-{index:05d}-of-{dp:05d}.pt")
            torch.save({"indices": torch.tensor(mine), "outputs": rows}, path)
        found = _to_rank0(path, ctx.rank, distributed)
        return sorted(p for p in found if p) if found is not None else None
    parts = _to_rank0((index, rows) if counts else None, ctx.rank, distributed)
    if parts is None:
        return None
    by_index = dict(p for p in parts if p is not None)
    return interleave([by_index[i] for i in range(dp)])


def _output(parallel: ParallelModel, batch: Any) -> Any:
    """The model's output for ``batch``: ``model(**batch)`` for a Mapping, ``model(input)``
    for an (input, target) pair, else ``model(batch)``; under a pipeline, on its last stage
    (None elsewhere)."""
    pair = isinstance(batch, tuple | list) and len(batch) == 2 and not hasattr(batch, "_fields")
    piped = parallel.pipeline
    if piped is not None:
        if isinstance(batch, Mapping):  # (the first stage reads one tensor: input_ids)
            inputs = batch[first_input_name(piped.root)]
        else:
            inputs = batch[0] if pair else batch
        return pipeline_forward.forward(piped, inputs)
    if isinstance(batch, Mapping):
        return parallel.model(**batch)
    return parallel.model(batch[0] if pair else batch)


def _tensors_only(output: Any) -> Any:
    """``output`` with what has no rows to put in data order left out: values that are
    neither tensors nor containers of them (a transformers cache) and scalars (a batch's
    loss)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() > 0 else None
    if isinstance(output, Mapping):
        kept = {k: _tensors_only(v) for k, v in output.items()}
        return _rebuilt(output, {k: v for k, v in kept.items() if v is not None})
    if isinstance(output, tuple | list) and not hasattr(output, "_fields"):
        return type(output)(_tensors_only(v) for v in output)
    return None


def concat(pieces: list[Any]) -> Any:
    """Batches' outputs of one structure joined along their first dimension."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        shapes = {tuple(p.shape[1:]) for p in pieces}
        if len(shapes) > 1:
            raise ValueError(
                f"the model's outputs have different shapes from batch to batch ({sorted(shapes)}"
                "), so they cannot be joined into one tensor: pad the data to one length (e.g. "
                "padding='max_length'), or pass output_dir= to keep each rank's batches in files"
            )
        return torch.cat(pieces)
    if isinstance(first, Mapping):
        return _rebuilt(first, {k: concat([p[k] for p in pieces]) for k in first})
    if isinstance(first, tuple | list):
        return type(first)(concat([p[i] for p in pieces]) for i in range(len(first)))
    return first


def interleave(parts: list[Any]) -> Any:
    """One structure from data-parallel rank ``i``'s rows ``parts[i]`` (its samples ``i, i +
    dp, ...``), in data order."""
    first, dp = parts[0], len(parts)
    if isinstance(first, torch.Tensor):
        total = sum(p.shape[0] for p in parts)
        out = first.new_empty((total, *first.shape[1:]))
        for i, part in enumerate(parts):
            out[i::dp] = part
        return out
    if isinstance(first, Mapping):
        return _rebuilt(first, {k: interleave([p[k] for p in parts]) for k in first})
    if isinstance(first, tuple | list):
        return type(first)(interleave([p[i] for p in parts]) for i in range(len(first)))
    return first


def _rebuilt(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """``items`` as ``type(original)`` (a transformers ``ModelOutput`` too), else a dict."""
    if type(original) is dict:
        return items
    try:
        return type(original)(**items)
    except TypeError:
        return items


def _to_rank0(value: Any, rank: int, distributed: bool) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (rank order), None elsewhere (a collective)."""
    if not distributed:
        return [value]
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
