"""A static PNG summary of a run (matplotlib), for headless runs and reports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

EVAL_COLOR = "#c2185b"
"""The evaluation loss, here as on the dashboard (a colour no rank's line takes)."""
LAYOUT_COLOR = "#6a3d9a"
"""A layout change's marker, here as on the dashboard."""


class TrainResult(Protocol):
    """What a plot reads of a ``axon_nb.train.TrainResult`` (this module does not import
    it: the result imports the plot)."""

    name: str
    ranks: list[dict[str, Any]]
    history: list[dict[str, Any]]
    layout_change: dict[str, Any] | None

    @property
    def losses(self) -> list[float]: ...


def plot_result(result: TrainResult, path: str | Path | None = None) -> Figure:
    """Loss per step (training, per rank, evaluation; a marker where a resumed call moved the
    run to another strategy), model-state memory per rank and communication share per rank.

    Example::

        plot_result(result, "run.png")   # what ``result.plot("run.png")`` does
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.6), layout="constrained")
    loss_ax, memory_ax, comm_ax = fig.subplots(1, 3)
    steps = [h["step"] for h in result.history]
    loss_ax.plot(steps, result.losses, label="train loss (global mean)", linewidth=2)
    if result.history and len(result.ranks) > 1:
        for rank in range(len(result.ranks)):
            per_rank = [h["per_rank"]["loss"][rank] for h in result.history]
            if all(value is None for value in per_rank):
                continue  # a rank that computes no loss (an earlier pipeline stage)
            loss_ax.plot(steps, per_rank, linewidth=0.8, alpha=0.6, label=f"rank {rank}")
    evals = [h for h in result.history if (h.get("eval") or {}).get("loss") is not None]
    if evals:
        eval_steps, eval_loss = [h["step"] for h in evals], [h["eval"]["loss"] for h in evals]
        loss_ax.plot(eval_steps, eval_loss, "o--", color=EVAL_COLOR, label="eval loss", ms=3)
    if result.layout_change:
        _mark_layout_change(loss_ax, result.layout_change)
    loss_ax.set(title=f"{result.name}: loss", xlabel="step")
    loss_ax.legend(fontsize=7)

    ranks = [r["rank"] for r in result.ranks]
    parts = ("param_bytes", "grad_bytes", "optimizer_bytes")
    bottom = [0.0] * len(ranks)
    for part in parts:
        mib = [_get(r["memory"], part) / 2**20 for r in result.ranks]
        memory_ax.bar(ranks, mib, bottom=bottom, label=part.removesuffix("_bytes"))
        bottom = [b + m for b, m in zip(bottom, mib, strict=True)]
    memory_ax.set(title="model state per rank (MiB)", xlabel="rank", xticks=ranks)
    memory_ax.legend(fontsize=7)

    share = [_comm_share(result, r) for r in ranks]
    comm_ax.bar(ranks, [100 * s for s in share], color="#e6550d")
    comm_ax.set(title="time in collectives (%)", xlabel="rank", xticks=ranks, ylim=(0, 100))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _mark_layout_change(ax: Axes, change: dict[str, Any]) -> None:
    """A dotted vertical line at the move's step, labelled at its foot (the curve of the call
    starts there, high at the top) and in the legend."""
    move = f"{change['from']} → {change['to']}"
    ax.axvline(
        change["step"],
        color=LAYOUT_COLOR,
        linestyle=":",
        linewidth=1.5,
        label=f"{move} at step {change['step']} ({change['seconds']:.1f} s)",
    )
    ax.annotate(
        move,
        xy=(change["step"], 0),
        xycoords=("data", "axes fraction"),
        xytext=(3, 3),
        textcoords="offset points",
        color=LAYOUT_COLOR,
        fontsize=7,
    )


def _get(memory: dict[str, Any], key: str) -> float:
    return float(memory.get(key, 0) or 0)


def _comm_share(result: TrainResult, rank: int) -> float:
    step_time = sum(h["per_rank"]["step_time_s"][rank] or 0 for h in result.history)
    comm_time = sum(h["per_rank"]["comm_time_s"][rank] or 0 for h in result.history)
    return min(1.0, comm_time / step_time) if step_time else 0.0
