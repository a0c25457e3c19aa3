"""What the dashboard shows, computed from the metrics stream; no widgets here, so it is
tested by feeding it a recorded stream.

Messages follow ``axon_nb.metrics.stream`` (schema ``axon_nb.metrics/1``).
"""

from __future__ import annotations

import time
from typing import Any

from axon_nb.spec.world_change import describe_change

STALL_AFTER_S = 10.0
"""A running rank with no publication for this long is shown as stalled."""
MAX_POINTS = 400
"""Loss points kept per series; older ones are thinned (every other one dropped)."""


class DashboardState:
    """Folds per-rank publications into progress, loss (training and evaluation), layout
    changes, memory, communication and status.

    Example::

        state = DashboardState(world_size=2)
        state.update(0, message)          # one publication of rank 0
        state.snapshot()["progress"]      # {"step": ..., "total": ..., "eta_s": ..., ...}
    """

    def __init__(
        self, world_size: int, *, stall_after_s: float = STALL_AFTER_S, max_points: int = MAX_POINTS
    ) -> None:
        self.world_size = world_size
        self.stall_after_s = stall_after_s
        self.max_points = max_points
        self.latest: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, str] = {}
        self.notes: list[str] = []
        """Events of the run shown beside its progress (e.g. a restart after a failure)."""
        self.peaks: dict[int, int] = {}
        self.steps: list[int] = []
        self.loss: list[float] = []
        self.rank_loss: dict[int, dict[int, float]] = {r: {} for r in range(world_size)}
        self.rates: dict[int, float] = {}
        self.evals: dict[int, dict[str, Any]] = {}
        """Evaluations by step (``loss``, metrics, ``samples``), as the records carry them."""
        self.trace_summary: list[dict[str, Any] | None] = []
        """With ``trace=``: per rank (rank order), its trace's summary (``top_ops`` as ``(name,
        self_ms)`` pairs, ``comm_share``, ...) or None; empty until the run's end fills it."""
        self.layout_changes: list[dict[str, Any]] = []
        """Each move of the run to another strategy (``step``, ``from``, ``to``, ``seconds``),
        oldest first: a ``resume=True`` call under a new strategy begins with one."""
        self.expert_tokens: dict[int, list[int]] = {}
        """With expert parallelism: per rank, the tokens it routed to each expert in its latest
        step (all MoE layers together)."""
        self._pending: list[tuple[int, float]] = []
        self._pending_evals: list[dict[str, Any]] = []
        self.frozen = False
        self.left: set[int] = set()
        """Ranks a resize removed (``cluster.resize``): their rows stay, marked ``left``."""

    # -- input -----------------------------------------------------------------------------

    def update(self, rank: int, message: dict[str, Any]) -> None:
        """Take one publication of ``rank`` (records may repeat earlier ones)."""
        if self.frozen:
            return
        self.latest[rank] = {k: v for k, v in message.items() if k != "records"}
        if message.get("status") == "failed" and message.get("error"):
            self.errors[rank] = message["error"]
        memory = message.get("memory") or {}
        peak = max(_held(memory), int(memory.get("peak_bytes", 0)))
        self.peaks[rank] = max(self.peaks.get(rank, 0), peak)
        self._take_layout_change(message.get("layout_change"))
        last = self.steps[-1] if self.steps else 0
        records = message.get("records") or ()
        if records:
            self.rates[rank] = records[-1]["samples_per_s"]
            if records[-1].get("expert_tokens") is not None:
                self.expert_tokens[rank] = records[-1]["expert_tokens"]
        for record in records:
            step = record["step"]
            self.rank_loss.setdefault(rank, {})[step] = record["rank_loss"]
            if step > last:  # every rank reports the same global loss; take it once
                self.steps.append(step)
                self.loss.append(record["loss"])
                self._pending.append((step, record["loss"]))
                last = step
            self._take_eval(step, record.get("eval"))
        if len(self.steps) > 2 * self.max_points:
            self._thin()

    def _take_eval(self, step: int, evaluation: dict[str, Any] | None) -> None:
        """Keep an evaluation once (every rank reports the same one), newer steps only."""
        if not evaluation or (self.evals and step <= max(self.evals)):
            return
        self.evals[step] = evaluation
        self._pending_evals.append({"step": step, **evaluation})
        if len(self.evals) > 2 * self.max_points:
            kept = sorted(self.evals)[::-1][::2]  # every other one, the newest kept
            self.evals = {s: self.evals[s] for s in sorted(kept)}

    def _take_layout_change(self, change: dict[str, Any] | None) -> None:
        """Keep a layout change once (every rank's every publication repeats it)."""
        if change and all(c["step"] != change["step"] for c in self.layout_changes):
            self.layout_changes = sorted([*self.layout_changes, change], key=lambda c: c["step"])

    def _thin(self) -> None:
        """Drop every other point, per-rank losses of the dropped steps too (bounded memory)."""
        self.steps, self.loss = self.steps[::2], self.loss[::2]
        kept, newest = set(self.steps), self.steps[-1]
        for losses in self.rank_loss.values():
            for step in [s for s in losses if s <= newest and s not in kept]:
                del losses[step]

    def resize(self, old: int, new: int, step: int) -> None:
        """The run goes on with ``new`` ranks from ``step`` (it had ``old``): a note says
        which ranks joined or left; rows cover every rank the run had, those that left marked
        so; the ranks' earlier statuses are let go (each publishes anew)."""
        self.notes.append(f"{describe_change(old, new)} at step {step} ({old} -> {new} ranks)")
        self.left = {r for r in self.left | set(range(new, old)) if r >= new}
        self.world_size = max(self.world_size, new, old)
        for rank in range(self.world_size):
            self.rank_loss.setdefault(rank, {})
        self.latest = {r: m for r, m in self.latest.items() if r in self.left}
        self.rates.clear()  # (the old world's; the slowest of the new one's sets it)
        self.expert_tokens.clear()
        self.frozen = False

    def fail(self, rank: int, error: str) -> None:
        """Mark ``rank`` failed (an error seen by the kernel, e.g. before it ever published)."""
        self.errors[rank] = error

    def freeze(self) -> None:
        """The run has ended: keep the final state, ignore anything later."""
        self.frozen = True

    # -- output ----------------------------------------------------------------------------

    def status(self, rank: int, now: float | None = None) -> str:
        """``waiting``, ``running``, ``finished``, ``stopped``, ``failed``, ``stalled`` or
        ``left`` (a resize removed it)."""
        if rank in self.left:
            return "left"
        if rank in self.errors:
            return "failed"
        message = self.latest.get(rank)
        if message is None:
            return "waiting"
        status = message["status"]
        now = time.time() if now is None else now
        silent = now - message["heartbeat"] > self.stall_after_s
        return "stalled" if status == "running" and silent and not self.frozen else status

    def progress(self) -> dict[str, Any]:
        """Step (slowest rank), total, elapsed, ETA, throughput and the last loss."""
        if not self.latest:
            return {"step": 0, "total": 0, "start": 0, "elapsed_s": 0.0, "eta_s": None,
                    "samples_per_s": 0.0, "loss": None, "checkpoint": None,
                    "notes": list(self.notes)}  # fmt: skip
        messages = [m for r, m in self.latest.items() if r not in self.left]
        if not messages:  # (just resized: the new world has not published yet)
            messages = list(self.latest.values())
        step = min(m["step"] for m in messages)
        start = messages[0]["start_step"]
        total = messages[0]["total_steps"]
        elapsed = max(m["elapsed_s"] for m in messages)
        done = step - start
        rate = done / elapsed if elapsed > 0 and done else 0.0
        eta = (total - step) / rate if rate else None
        throughput = self._recent_throughput()
        return {"step": step, "total": total, "start": start, "elapsed_s": elapsed,
                "eta_s": eta if step < total else 0.0, "samples_per_s": throughput,
                "loss": self.loss[-1] if self.loss else None,
                "checkpoint": messages[0].get("checkpoint"), "notes": list(self.notes)}  # fmt: skip

    def memory(self) -> list[dict[str, Any]]:
        """Per rank: ``held`` (model-state bytes or CUDA allocated), ``peak``, and the parts."""
        rows = []
        for rank in range(self.world_size):
            memory = (self.latest.get(rank) or {}).get("memory") or {}
            rows.append({"rank": rank, "held": _held(memory), "peak": self.peaks.get(rank, 0),
                         **memory})  # fmt: skip
        return rows

    def comm(self) -> list[dict[str, Any]]:
        """Per rank: per-kind bytes and seconds per step, and the share of step time spent."""
        rows = []
        for rank in range(self.world_size):
            totals = (self.latest.get(rank) or {}).get("comm_totals") or {}
            message = self.latest.get(rank) or {}
            steps = max(1, message.get("step", 0) - message.get("start_step", 0))
            elapsed = message.get("elapsed_s") or 0.0
            per_kind = {
                kind: {"bytes": c["bytes"] / steps, "time_s": c["time_s"] / steps}
                for kind, c in totals.items()
            }
            seconds = sum(c["time_s"] for c in totals.values())
            share = min(1.0, seconds / elapsed) if elapsed else 0.0
            rows.append({"rank": rank, "per_step": per_kind, "share": share})
        return rows

    def experts(self) -> dict[str, Any] | None:
        """With expert parallelism: tokens routed to each expert in the latest step, in total
        and by the rank that routed them, and ``imbalance`` (busiest expert / mean; 1.0 is
        perfectly balanced); None for other runs."""
        if not self.expert_tokens:
            return None
        per_rank = [self.expert_tokens.get(r) for r in range(self.world_size)]
        known = [t for t in per_rank if t is not None]
        total = [sum(column) for column in zip(*known, strict=True)]
        mean = sum(total) / len(total) if total else 0
        return {
            "total": total,
            "per_rank": per_rank,
            "imbalance": max(total) / mean if mean else 1.0,
        }

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Everything the widget shows, as plain JSON-able data."""
        return {
            "progress": self.progress(),
            "ranks": [
                {"rank": r, "status": self.status(r, now), "error": self.errors.get(r)}
                for r in range(self.world_size)
            ],
            "loss": {
                "steps": list(self.steps),
                "global": list(self.loss),
                "per_rank": [
                    [self.rank_loss.get(r, {}).get(s) for s in self.steps]
                    for r in range(self.world_size)
                ],
                "eval": [{"step": s, **e} for s, e in sorted(self.evals.items())],
            },
            "layout_changes": [dict(c) for c in self.layout_changes],
            "memory": self.memory(),
            "comm": self.comm(),
            "experts": self.experts(),
            "frozen": self.frozen,
            "trace_summary": list(self.trace_summary),
        }

    def take_new_points(self) -> list[tuple[int, float]]:
        """Global-loss points added since the last call (for incremental chart updates)."""
        taken, self._pending = self._pending, []
        return taken

    def take_new_evals(self) -> list[dict[str, Any]]:
        """Evaluations (``{"step", "loss", ...}``) added since the last call."""
        taken, self._pending_evals = self._pending_evals, []
        return taken

    def _recent_throughput(self) -> float:
        """Global samples/s of the latest step, as the slowest rank saw it."""
        return float(min(self.rates.values())) if self.rates else 0.0


def _held(memory: dict[str, Any]) -> int:
    if "cuda_allocated" in memory:
        return int(memory["cuda_allocated"])
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    return int(sum(memory.get(k, 0) for k in keys))
