"""``TrainResult``: what a training call returns, built from the ranks' step records."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PER_RANK_FIELDS = (
    "loss", "step_time_s", "comm_bytes", "comm_time_s", "bubble", "expert_tokens",
)  # fmt: skip
"""Step figures kept for every rank under ``history[i]["per_rank"]`` (``bubble``: the
share of a pipeline step a stage spent idle; ``expert_tokens``: with expert parallelism, the
tokens a rank routed to each expert; None for other strategies)."""


def merge_records(by_rank: Mapping[int, Mapping[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One history entry per step from every rank's records (``{rank: {step: record}}``).

    Global figures come from the lowest rank that has the step; ``per_rank`` lists each
    rank's own figures (None where a rank's record has not arrived yet).
    """
    ranks = sorted(by_rank)
    steps = sorted({step for records in by_rank.values() for step in records})
    history = []
    for step in steps:
        present = [by_rank[r][step] for r in ranks if step in by_rank[r]]
        first = present[0]
        entry = {k: v for k, v in first.items() if k not in ("rank_loss", "comm")}
        entry["step_time_s"] = max(r["step_time_s"] for r in present)
        entry["per_rank"] = {
            name: [_rank_field(by_rank[r].get(step), name) for r in ranks]
            for name in PER_RANK_FIELDS
        }
        history.append(entry)
    return history


def _rank_field(record: dict[str, Any] | None, name: str) -> Any:
    if record is None:
        return None
    return record["rank_loss"] if name == "loss" else record.get(name)


@dataclass(kw_only=True)
class TrainResult:
    """The outcome of ``cluster.train`` or ``train_local``.

    Example::

        result = cluster.train(model=make_model, data=ds, steps=200, batch_size=64)
        result.losses[-1], result.samples_per_s, result.ranks[0]["memory"]
    """

    name: str
    """Name of the model on the ranks (``%%axon`` variable)."""
    strategy: str
    """The strategy, as configured."""
    status: str
    """``finished``, or ``stopped`` (Ctrl-C or ``handle.stop()``) at a step boundary."""
    start_step: int
    """Global step count when the call started (non-zero when resumed)."""
    step: int
    """Global step count when it ended."""
    history: list[dict[str, Any]]
    """One entry per step: ``step``, ``loss`` (global mean), ``lr``, ``grad_norm``, ``samples``,
    ``samples_per_s``, ``step_time_s`` (slowest rank), ``comm_bytes``, ``comm_time_s`` and
    ``per_rank`` (``loss``, ``step_time_s``, ``comm_bytes``, ``comm_time_s`` lists by rank);
    at an evaluated step also ``eval`` (``loss``, metrics, ``samples``: see ``evals``)."""
    ranks: list[dict[str, Any]]
    """Per rank: ``device``, ``memory`` (bytes), ``comm_totals`` (per kind), ``elapsed_s``."""
    data_ended_at: int | None = None
    """Iterable data: the step at which the stream ran out on some rank (every rank stopped
    there, ``status`` stays ``finished``); None when it lasted."""
    checkpoint: dict[str, Any] | None = None
    """With ``checkpoint_dir``: the newest complete periodic checkpoint (``step``, ``path``)."""
    preempted: dict[str, Any] | None = None
    """After a preemption notice (``Cluster(preempt_signal=...)``): the checkpoint every rank
    wrote (``step``, ``path``, ``signal``, ``notice_at``, ``saved_at``); the run is stopped."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """With ``max_restarts``: each recovery (``error``, ``failed_at_step``, ``resumed_from``,
    ``seconds``), oldest first; ``history`` runs on through them as one."""
    resizes: list[dict[str, Any]] = field(default_factory=list)
    """Each ``cluster.resize`` during the run (``step``: where it stopped, ``from``, ``to``:
    world sizes, ``seconds``: from the resize call, its wait for the step boundary included,
    to the new world joined), oldest first; ``history`` runs on through them as one."""
    layout_change: dict[str, Any] | None = None
    """With ``resume=True`` and another strategy: the move this call began with (``step``,
    ``from``, ``to``, ``seconds``), done in memory on the ranks."""
    traces: list[dict[str, Any] | None] | None = None
    """With ``trace=``: each rank's trace summary (``path``, ``steps``, ``top_ops``,
    ``compute_ms``, ``comm_ms``, ``comm_share``), rank order; see ``trace_dir``."""
    model: Any = field(default=None, repr=False)
    """``train_local`` only: the trained module itself."""
    dashboard: Any = field(default=None, repr=False)
    """``cluster.train`` only: the run's :class:`~axon_nb.widgets.dashboard.Dashboard`
    (``result.dashboard.save("run.html")`` exports it)."""

    def plot(self, path: Any = None) -> Any:
        """A matplotlib summary (loss, memory and communication per rank); PNG at ``path``.

        Example::

            result.plot("run.png")
        """
        from axon_nb.widgets._plot import plot_result

        return plot_result(self, path)

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"

    @property
    def memory(self) -> list[dict[str, int]]:
        """Per rank (rank order), bytes: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``
        (this rank's shards, at the end), ``peak_bytes`` (CUDA peak on GPU; on CPU, tracked
        tensor bytes during the call's first step), ``rss_bytes`` and on GPU the CUDA figures."""
        return [r["memory"] for r in self.ranks]

    @property
    def bubble(self) -> float | None:
        """Pipeline runs: the mean idle share of a stage's step time over ranks and steps
        (the first step left out), measured; None for other strategies."""
        values = [
            b
            for h in self.history[1:] or self.history
            for b in h["per_rank"]["bubble"]
            if b is not None
        ]
        return sum(values) / len(values) if values else None

    @property
    def expert_tokens(self) -> list[int] | None:
        """Expert-parallel runs: tokens routed to each expert over the whole run, all ranks and
        MoE layers together (the load balance); None for other strategies."""
        rows = [t for h in self.history for t in h["per_rank"]["expert_tokens"] if t]
        return [sum(column) for column in zip(*rows, strict=True)] if rows else None

    @property
    def evals(self) -> list[dict[str, Any]]:
        """With ``eval_data``: one entry per evaluation, ``{"step", "loss", <metric>...,
        "samples"}`` (sample-weighted means over the whole evaluation set), oldest first."""
        return [{"step": h["step"], **h["eval"]} for h in self.history if h.get("eval")]

    @property
    def trace_dir(self) -> str | None:
        """With ``trace=``: the directory of the ranks' Chrome/Perfetto traces
        (``rank<r>.pt.trace.json``); None without one."""
        import os

        paths = [t["path"] for t in self.traces or [] if t is not None]
        return os.path.dirname(paths[0]) if paths else None

    @property
    def steps(self) -> int:
        """Steps run by this call."""
        return self.step - self.start_step

    @property
    def losses(self) -> list[float]:
        """Global mean loss per step."""
        return [h["loss"] for h in self.history]

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput: samples over step time, leaving out the first step."""
        steady = self.history[1:] or self.history
        seconds = sum(h["step_time_s"] for h in steady)
        return sum(h["samples"] for h in steady) / seconds if seconds else 0.0

    def __repr__(self) -> str:
        loss = f", loss {self.losses[0]:.4g} -> {self.losses[-1]:.4g}" if self.history else ""
        return (
            f"<TrainResult {self.name!r} {self.status} at step {self.step} "
            f"({self.steps} steps, {len(self.ranks)} ranks{loss}, "
            f"{self.samples_per_s:.1f} samples/s)>"
        )


def build_result(
    summaries: list[dict[str, Any]], *, name: str, strategy: str, model: Any = None
) -> TrainResult:
    """Combine the ranks' summaries (rank order) into one :class:`TrainResult`."""
    by_rank = {s["rank"]: {r["step"]: r for r in s["records"]} for s in summaries}
    statuses = {s["status"] for s in summaries}
    return TrainResult(
        name=name,
        strategy=strategy,
        status="stopped" if "stopped" in statuses else "finished",
        start_step=summaries[0]["start_step"],
        step=summaries[0]["step"],
        history=merge_records(by_rank),
        checkpoint=summaries[0].get("checkpoint"),
        preempted=summaries[0].get("preempted"),
        data_ended_at=summaries[0].get("data_ended_at"),
        layout_change=summaries[0].get("layout_change"),
        traces=[s.get("trace") for s in summaries] if summaries[0].get("trace") else None,
        ranks=[
            {k: s[k] for k in ("rank", "device", "memory", "comm_totals", "elapsed_s")}
            for s in summaries
        ],
        model=model,
    )
