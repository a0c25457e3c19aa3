"""``trace=(start_step, steps)``: ``torch.profiler`` around those steps of a call on every rank,
one Chrome/Perfetto trace per rank and a short summary of it.

The profiler starts just before the call's step ``start_step`` (the first step is 1) and
stops after ``steps`` steps; no other step runs under it. Each rank writes
``<log_dir>/trace-<run>/rank<r>.pt.trace.json`` (Perfetto opens it; TensorBoard's profiler
plugin reads ``*.pt.trace.json``) and summarises its events: the top operators by self
time, and the share of self time spent in collectives (events named for a collective or a
process group backend: ``gloo:all_reduce``, ``nccl:all_gather``, ``c10d::...``). Example::

    trace = StepTrace((5, 3), log_dir="/runs/gpt", run_id="ab12", rank=0, device=device)
    for step in range(1, steps + 1):
        trace.before(step)
        ...  # the step
        trace.after(step)
    trace.summary   # {"path", "top_ops", "compute_ms", "comm_ms", "comm_share", "steps"}
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

COLLECTIVE = re.compile(
    r"gloo:|nccl:|c10d::|all_reduce|allreduce|all_gather|allgather|reduce_scatter|"
    r"broadcast|all_to_all|alltoall|barrier|send|recv",
    re.IGNORECASE,
)
"""Names of collective and point-to-point events in a trace."""
TOP_OPS = 5
"""Operators listed per rank in the summary."""


class StepTrace:
    """The profiler of one call's traced steps on one rank."""

    def __init__(
        self,
        trace: tuple[int, int],
        *,
        log_dir: str,
        run_id: str,
        rank: int,
        device: torch.device,
    ) -> None:
        self.first, self.count = trace
        self.directory = os.path.join(log_dir, f"trace-{run_id[:8]}")
        self.path = os.path.join(self.directory, f"rank{rank}.pt.trace.json")
        self.cuda = device.type == "cuda"
        self._profile: profile | None = None
        self.summary: dict[str, Any] | None = None
        """After the last traced step: what :func:`summarize` says of the trace."""

    def before(self, step: int) -> None:
        """Start profiling when the call's step ``step`` is the first traced one."""
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profile = profile(activities=activities, record_shapes=False)
            self._profile.__enter__()

    def after(self, step: int, *, settle: Callable[[], None] | None = None) -> None:
        """Stop, write the trace and summarise it after the last traced step. ``settle``
        first waits for the collectives the step left running (the loop's agreement): the
        profiler is not safe to stop while a backend's thread records one (a rank died of a
        corrupted heap just after ``profiler_stop`` once, in a suite of FSDP on gloo)."""
        if self._profile is None or step != self.first + self.count - 1:
            return
        if settle is not None:
            settle()
        if self.cuda:
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        self._profile.export_chrome_trace(self.path)
        self.summary = {
            "path": self.path,
            "steps": [self.first, self.first + self.count - 1],
            **summarize(self._profile, self.cuda),
        }
        self._profile = None

    def close(self, *, settle: Callable[[], None] | None = None) -> None:
        """Stop a profile the call ended inside of (a stop or a failure), writing nothing;
        ``settle`` as for :meth:`after` (not after a failure: a peer may be gone)."""
        if self._profile is not None:
            if settle is not None:
                settle()
            self._profile.__exit__(None, None, None)
            self._profile = None


def summarize(prof: profile, cuda: bool) -> dict[str, Any]:
    """Top operators by self time, and compute against communication time, in ms."""
    attribute = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [(e.key, getattr(e, attribute) / 1e3) for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0 and not r[0].startswith("ProfilerStep")]
    comm = sum(ms for name, ms in rows if COLLECTIVE.search(name))
    total = sum(ms for _, ms in rows)
    top = sorted(rows, key=lambda r: -r[1])[:TOP_OPS]
    return {
        "top_ops": [[name, round(ms, 3)] for name, ms in top],
        "compute_ms": round(total - comm, 3),
        "comm_ms": round(comm, 3),
        "comm_share": comm / total if total else 0.0,
    }
