"""The kernel's short table of a traced run (``trace=``): per rank, the top operators by self
time, compute against communication time, and which rank was slowest. Example::

    print(trace_table(result.traces))
    # rank  compute ms  comm ms  comm %  top operators (self ms)
    #    0       41.2      9.8     19%  aten::mm 12.1, aten::addmm 8.0, ...
    # slowest: rank 1 (53.0 ms)
"""

from __future__ import annotations

from typing import Any


def trace_table(traces: list[dict[str, Any] | None]) -> str:
    """The table of the ranks' trace summaries (rank order; None for a rank without one)."""
    lines = [f"{'rank':>4}  {'compute ms':>10}  {'comm ms':>8}  {'comm %':>6}  top operators"]
    totals = {}
    for rank, summary in enumerate(traces):
        if summary is None:
            lines.append(f"{rank:>4}  (no trace)")
            continue
        totals[rank] = summary["compute_ms"] + summary["comm_ms"]
        top = ", ".join(f"{name} {ms:.1f}" for name, ms in summary["top_ops"][:3])
        lines.append(
            f"{rank:>4}  {summary['compute_ms']:>10.1f}  {summary['comm_ms']:>8.1f}  "
            f"{summary['comm_share']:>6.0%}  {top}"
        )
    if totals:
        slowest = max(totals, key=lambda r: totals[r])
        steps = next(s["steps"] for s in traces if s is not None)
        lines.append(
            f"slowest: rank {slowest} ({totals[slowest]:.1f} ms over steps {steps[0]}-{steps[1]})"
        )
    return "\n".join(lines)
