"""Saving what the surviving ranks hold after a rank died, with no collective (``cluster.rescue``).

The process group is broken once a rank is gone, so nothing here talks to another rank. Each
survivor writes the pieces of the model and optimizer state it holds, as they sit in its
memory, into the rescue's partial directory (:func:`write_pieces`): every entry is named as a
checkpoint names it and placed in the whole tensor by its global offset, read from its DTensor
layout (a replicated entry is one piece covering the whole). One survivor then reads every
piece file (:func:`assemble`), puts each entry together, checks that every element is held
by some survivor (and that replicas agree), and writes an ordinary full checkpoint: the
same ``state.pt`` and marker as ``cluster.save(path, kind="full")``.

Optimizer state sharded by ZeRO-1/2 lives in bucket or partition layouts of their own; a
rescue of those layouts keeps the model and says that the optimizer state was not kept.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from axon_nb.parallel.activation_checkpoint import canonical_name, parameter_names
from axon_nb.parallel.optim_state import by_name, merge_groups
from axon_nb.rank import runtime
from axon_nb.rank.checkpoint import checkpoint_io
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.checkpoint_format import Checkpoint, SaveTarget

PIECES = "pieces-rank{rank}.pt"


def write_pieces(name: str, directory: str) -> dict[str, Any]:
    """Write this rank's pieces of run ``name`` into ``directory``; what was written.

    Example (on every surviving rank)::

        write_pieces("model", "/ckpt/rescued.partial-3f2a")   # {"rank": 0, "step": 12, ...}
    """
    state = checkpoint_io.run_named(name, "rescue")
    rank = runtime.context().rank
    _resharded(state.parallel.root)
    optimizer, why_not = _optimizer_pieces(state)
    blob: dict[str, Any] = {
        "rank": rank,
        "step": state.step,
        "model": {k: _piece(v) for k, v in _model_entries(state).items()},
        "optimizer": optimizer,
        "optimizer_missing": why_not,
        "rng": torch.get_rng_state(),
    }
    torch.save(blob, os.path.join(directory, PIECES.format(rank=rank)))
    return {"rank": rank, "step": state.step, "entries": len(blob["model"])}


def assemble(name: str, target: SaveTarget, dead: list[int]) -> dict[str, Any]:
    """(One survivor) put the pieces in ``target.partial`` together and complete the
    checkpoint at ``target.path``; raises, naming what is missing, if the survivors together
    do not hold the whole model.

    Returns the step and, under ``"optimizer_missing"``, why the optimizer state was not
    kept (None when it was).
    """
    state = checkpoint_io.run_named(name, "rescue")
    files = sorted(glob.glob(os.path.join(target.partial, PIECES.format(rank="*"))))
    blobs = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    lost = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}"
    steps = {b["rank"]: b["step"] for b in blobs}
    if len(set(steps.values())) > 1:
        raise RuntimeError(
            f"the surviving ranks stopped at different steps ({steps}), so their pieces do "
            "not form one model. Nothing was saved"
        )
    shapes = checkpoint_io.model_shapes(state.module)
    model, gaps = _put_together([b["model"] for b in blobs], shapes)
    if gaps:
        raise RuntimeError(
            f"the surviving ranks do not hold the whole model: {lost} held the only copy of "
            f"{_listed(gaps)}. Nothing was saved; with this layout only a checkpoint "
            "(cluster.save, or train(checkpoint_dir=...)) keeps a run when a rank dies"
        )
    optimizer, why_not = _optimizer(blobs, state, lost)
    for f in files:
        os.remove(f)
    checkpoint_io.write_full(
        {"model": model, "optimizer": optimizer, "rng": {str(b["rank"]): b["rng"] for b in blobs}},
        target.partial,
    )
    meta = Checkpoint(
        path=target.path,
        kind="full",
        name=state.name,
        step=state.step,
        world_size=runtime.context().world_size,
        strategy=state.strategy.describe(),
        optimizer=checkpoint_io.optimizer_class(state.optimizer),
        model=shapes,
        # (no strategy state: a survivor's stale gradients or outer loop are not gathered)
        trainer=checkpoint_io.trainer_state(state, optimizer is not None, strategy_state=False),
    )
    checkpoint_io.complete(meta, target.partial, target.path, private=target.private)
    return {"step": state.step, "optimizer_missing": why_not}


def _resharded(root: torch.nn.Module) -> None:
    """Put FSDP2 modules back in their sharded state: a survivor stopped inside a forward or
    backward holds gathered parameters, which are not the optimizer's (and may be partly
    filled). Resharding needs no collective; the local shards are intact."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _model_entries(state: TrainState) -> dict[str, Any]:
    """This rank's model state by checkpoint name: a pipeline rank's own stages only."""
    entries = state.parallel.root.state_dict(keep_vars=True)
    pipeline = state.parallel.pipeline
    if pipeline is not None:
        owned = {id(t) for part in pipeline.parts for t in [*part.parameters(), *part.buffers()]}
        entries = {k: v for k, v in entries.items() if id(v) in owned}
    return {canonical_name(k): v for k, v in entries.items()}


def _optimizer_pieces(state: TrainState) -> tuple[dict[str, Any] | None, str | None]:
    """This rank's optimizer state by parameter name, as pieces (None, and why, for layouts
    whose optimizer state is not kept per parameter)."""
    if state.parallel.data_parallel in ("zero1", "zero2"):
        return None, (
            "ZeRO shards the optimizer state across the ranks and the dead rank's shard is gone"
        )
    names = parameter_names(state.parallel.root)
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    named = by_name(state.optimizer.state_dict(), [names[id(p)] for p in params])
    pieces = {n: {k: _piece(v) for k, v in entry.items()} for n, entry in named["state"].items()}
    return {"state": pieces, "param_groups": named["param_groups"]}, None


def _piece(value: Any) -> Any:
    """A tensor as ``{"shape", "offset", "tensor"}``: its global shape, where its local part
    starts in it, and the local part on the CPU. Other values are kept as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):  # its local part and where that part sits
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        local = value.to_local()
    else:
        offset, local = (0,) * value.dim(), value
    return {"shape": list(value.shape), "offset": list(offset), "tensor": local.detach().cpu()}


def _put_together(
    parts: list[dict[str, Any]], expected: dict[str, list[int]] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Whole entries from every rank's pieces, and for each incomplete one what is missing."""
    whole: dict[str, Any] = {}
    held: dict[str, torch.Tensor] = {}
    for pieces in parts:
        for key, piece in pieces.items():
            if not (isinstance(piece, dict) and "offset" in piece):
                whole.setdefault(key, piece)
                continue
            local = piece["tensor"]
            if key not in whole:
                whole[key] = torch.empty(piece["shape"], dtype=local.dtype)
                held[key] = torch.zeros(piece["shape"], dtype=torch.bool)
            where = tuple(
                slice(o, o + n) for o, n in zip(piece["offset"], local.shape, strict=True)
            )
            seen = held[key][where]
            if seen.any() and not torch.equal(whole[key][where][seen], local[seen]):
                raise RuntimeError(
                    f"the surviving ranks hold different values of {key}, so they did not "
                    "stop at the same point of a step. Nothing was saved"
                )
            whole[key][where] = local
            held[key][where] = True
    gaps = {k: _missing_part(mask) for k, mask in held.items() if not bool(mask.all())}
    for key in expected or {}:
        if key not in whole:
            gaps[key] = "all of it"
    return whole, gaps


def _missing_part(mask: torch.Tensor) -> str:
    if mask.dim() == 0:
        return "all of it"
    rows = (~mask).reshape(mask.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    if rows == list(range(rows[0], rows[-1] + 1)):
        return f"rows {rows[0]}..{rows[-1]} of {mask.shape[0]}"
    return f"{int((~mask).sum())} of {mask.numel()} elements"


def _listed(gaps: dict[str, str], limit: int = 4) -> str:
    shown = [f"{k} ({v})" for k, v in list(gaps.items())[:limit]]
    more = f" and {len(gaps) - limit} more entries" if len(gaps) > limit else ""
    return ", ".join(shown) + more


def _optimizer(
    blobs: list[dict[str, Any]], state: TrainState, lost: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The whole optimizer state by name, or None and why it could not be kept."""
    reasons = [b["optimizer_missing"] for b in blobs if b["optimizer"] is None]
    if reasons:
        return None, reasons[0]
    per_rank = [b["optimizer"]["state"] for b in blobs]
    if not any(per_rank):
        return None, None  # no optimizer step yet: nothing to keep
    flat = [{f"{n}\0{k}": v for n, entry in s.items() for k, v in entry.items()} for s in per_rank]
    merged, gaps = _put_together(flat)
    held = {key.split("\0")[0] for key in merged}
    missing = sorted(set(_trainable_names(state)) - held) + sorted({k.split("\0")[0] for k in gaps})
    if missing:
        more = f" and {len(missing) - 4} more parameters" if len(missing) > 4 else ""
        return None, (
            f"{lost} held the only copy of the optimizer state of {', '.join(missing[:4])}{more}"
        )
    named: dict[str, dict[str, Any]] = {}
    for key, value in merged.items():
        param, entry = key.split("\0")
        named.setdefault(param, {})[entry] = value
    groups = [b["optimizer"]["param_groups"] for b in blobs]  # a pipeline rank's hold some
    order = list(parameter_names(state.parallel.root).values())
    return {"state": named, "param_groups": merge_groups(groups, order)}, None


def _trainable_names(state: TrainState) -> list[str]:
    names = parameter_names(state.parallel.root)
    params = {id(p): p for p in state.parallel.root.parameters()}
    return [n for i, n in names.items() if i in params and params[i].requires_grad]
