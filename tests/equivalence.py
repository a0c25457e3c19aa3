"""The check every strategy test makes: a distributed run equals the one-process reference."""

from __future__ import annotations

from typing import Any

import torch

import axon_nb


def full_params() -> dict[str, torch.Tensor]:
    """(On every rank) the run ``model``'s whole parameters, gathered by its strategy."""
    from axon_nb.rank.training import trainstate

    state = trainstate.get("model")
    full = state.parallel.full_state_dict()  # a collective: gathers shards and stages
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def check_equal(
    cluster: axon_nb.Cluster,
    ref: axon_nb.TrainResult,
    args: dict[str, Any],
    *,
    loss_tol: float,
    param_tol: float,
) -> axon_nb.TrainResult:
    """Train ``args`` on ``cluster``; its losses and gathered parameters must match ``ref``'s
    within the tolerances, and be identical on every rank."""
    result = cluster.train(**args)
    gap = max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True))
    assert gap < loss_tol, gap
    params = cluster.run(full_params, stream=False)
    for k, v in ref.model.state_dict().items():
        assert params[0][k].shape == v.shape, k
        assert (params[0][k] - v).abs().max().item() < param_tol, k
        assert all(torch.equal(params[0][k], other[k]) for other in params[1:]), k
    return result


def check_predictions(table: Any, *, memory_tol: float, comm_tol: float) -> None:
    """Every row of ``cluster.compare``'s ``table`` ran, and its predicted peak memory and
    communication bytes per step are within ``memory_tol`` and ``comm_tol`` (relative) of
    what the ranks measured."""
    off = []
    for row in table.rows:
        assert row["status"] == "ok", row
        memory = row["predicted_peak_bytes"] / row["peak_bytes"]
        comm = row["predicted_comm_bytes"] / row["comm_bytes_per_step"]
        if abs(memory - 1) > memory_tol or abs(comm - 1) > comm_tol:
            off.append(f"{row['strategy']}: memory x{memory:.3f}, communication x{comm:.3f}")
    assert not off, "predictions off:\n" + "\n".join(off)
