"""``%axon_status``: the ranks at a glance (host, device, backend, memory, runs) as a widget."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets


def status_widget(rows: list[dict[str, Any]]) -> ipywidgets.HTML:
    """A compact table of the ranks, one row each, with a memory bar scaled to the largest.

    Example::

        In [2]: %axon_status
    """
    top = max([_memory(r) for r in rows] + [1])
    body = "".join(
        "<tr>"
        f"<td>{r['rank']}</td><td>{html.escape(r['host'])}</td><td>{r['pid']}</td>"
        f"<td>{html.escape(r['device'])}</td><td>{r['backend']}</td>"
        f"<td><div class='axon-bar' style='flex:none;width:120px'><div class='axon-bar-held' "
        f"style='width:{100 * _memory(r) / top:.0f}%'></div></div></td>"
        f"<td>{_memory_text(r)}</td>"
        f"<td>{html.escape(', '.join(f'{n} @ step {s}' for n, s in r['runs'].items()) or '–')}</td>"
        "</tr>"
        for r in rows
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("rank", "host", "pid", "device", "backend", "memory", "", "training runs")
    )
    table = (
        "<table class='axon-status' style='border-collapse:collapse;font-size:12px'>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        "<style>.axon-status td,.axon-status th{padding:2px 8px;text-align:left}"
        ".axon-status .axon-bar{position:relative;height:10px;background:#f0f0f0}"
        ".axon-status .axon-bar-held{position:absolute;top:0;bottom:0;background:#3182bd}"
        "</style>"
    )
    return ipywidgets.HTML(table)


def status_text(rows: list[dict[str, Any]]) -> str:
    """The same table as plain text, for terminals and logs."""
    lines = [("rank", "host", "device", "backend", "memory", "training runs")]
    lines += [
        (str(r["rank"]), r["host"], r["device"], r["backend"], _memory_text(r),
         ", ".join(f"{n} @ step {s}" for n, s in r["runs"].items()) or "-")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _memory(row: dict[str, Any]) -> int:
    return int(row.get("cuda_allocated", row["rss_bytes"]))


def _memory_text(row: dict[str, Any]) -> str:
    if "cuda_allocated" not in row:
        return f"{_mib(row['rss_bytes'])} RSS"
    text = f"{_mib(row['cuda_allocated'])} of {_mib(row['cuda_total'])} GPU"
    if "gpu_util" in row:  # NVML's figures, where it is available
        text += f", util {row['gpu_util']}%, memory bandwidth {row['memory_bw_util']}%"
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
