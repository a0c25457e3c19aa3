"""One self-contained HTML page of a run (``Dashboard.save``), drawn here in Python.

The live widget draws its charts in the browser, so a page that embeds the widget needs
require.js and the widget manager from a CDN, and is blank without them (air-gapped clusters,
JavaScript off). This page has no script and fetches nothing: the charts are inline SVG with
their colours as attributes, the figures are tables, the CSS is in the page, and a
Content-Security-Policy forbids any load.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import TypeIs

TRAIN_COLOR = "#1f77b4"
RANK_COLORS = (
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
)
"""Per-rank colours, as the live widget draws them (rank r takes ``RANK_COLORS[r % 8]``)."""
EVAL_COLOR = "#c2185b"
LAYOUT_COLOR = "#6a3d9a"
"""A layout change's marker (a strategy move on ``resume=True``), as the live widget draws it."""
HELD_COLOR, PEAK_COLOR, COMM_COLOR, TRACK_COLOR = "#3182bd", "#c6dbef", "#e6550d", "#f0f0f0"
STATUS_COLORS = {
    "running": "#cfe8ff",
    "finished": "#cdeccd",
    "stopped": "#fff0b3",
    "failed": "#f8c4c4",
    "stalled": "#ffd8a8",
    "waiting": "#eeeeee",
    "left": "#f1f3f5",
}
MAX_DOTS = 200
"""Evaluation points get a dot each up to this many; beyond, the dashed line alone."""
EVAL_ROWS = 20
"""The evaluations table lists the latest this many."""

CSS = """
body { font: 13px/1.45 sans-serif; color: #222; max-width: 820px; margin: 16px auto; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 14px; margin: 18px 0 4px; }
table { border-collapse: collapse; margin: 4px 0; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; } td.num { text-align: right; }
.error { white-space: pre-wrap; color: #b00; font-family: monospace; font-size: 11px; }
.progress { height: 10px; background: #f0f0f0; margin: 4px 0; }
.progress > div { height: 100%; background: #3182bd; }
pre.hang { background: #fff4e5; color: #7a3e00; padding: 4px 6px; white-space: pre-wrap; }
svg { display: block; max-width: 100%; height: auto; }
table.bars td { border: none; padding: 1px 6px 1px 0; vertical-align: middle; }
.muted { color: #888; } .legend { margin: 2px 0 6px; font-size: 12px; }
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def render_html(snapshot: dict[str, Any], *, title: str, hang_report: str = "") -> str:
    """The page for ``DashboardState.snapshot()``: progress, loss chart (training per rank and
    evaluation, layout changes marked), memory and communication per rank, statuses,
    evaluations, trace summary.

    Example::

        page = render_html(state.snapshot(), title="gpt2 run")
        Path("run.html").write_text(page)
    """
    loss, trace = snapshot["loss"], snapshot.get("trace_summary") or []
    sections = [
        f"<h1>{_e(title)}</h1>",
        _progress(snapshot["progress"], frozen=snapshot["frozen"]),
        _section(
            "Loss",
            _loss_chart(loss, snapshot.get("layout_changes") or [])
            + _evals_table(loss.get("eval") or []),
        ),
        _section("Memory per rank", _memory_chart(snapshot["memory"])),
        _section("Communication per rank (per step)", _comm_chart(snapshot["comm"])),
        _section("Ranks", _status_table(snapshot["ranks"])),
    ]
    if trace:
        sections.append(_section("Trace summary", _trace_table(trace)))
    if hang_report:
        sections.append(_section("Hang report", f'<pre class="hang">{_e(hang_report)}</pre>'))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


# -- charts ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Line:
    """One series of a line chart; a None value breaks the line."""

    label: str
    """Its legend entry."""
    points: Sequence[tuple[float, float | None]]
    """``(step, value)`` pairs in step order."""
    color: str
    width: float = 1.0
    dashed: bool = False
    dots: bool = False
    """A dot at each point (sparse series: evaluations)."""
    css_class: str = ""


@dataclass(frozen=True, slots=True)
class Marker:
    """An event at one step, drawn as a labelled vertical line across a line chart."""

    step: float
    label: str
    """Written beside the line, at its foot."""
    legend: str
    """Its legend entry (and the line's tooltip): the label with what it needs said."""
    color: str = LAYOUT_COLOR
    css_class: str = "layout-change"


def line_chart(
    lines: Sequence[Line],
    *,
    markers: Sequence[Marker] = (),
    width: int = 640,
    height: int = 240,
) -> str:
    """An SVG line chart of ``lines`` (axes, min/max ticks) and ``markers``, its legend below.

    Example::

        line_chart([Line("train loss", [(1, 2.3), (2, 1.9)], "#1f77b4")],
                   markers=[Marker(0, "DDP() → FSDP()", "DDP() → FSDP() at step 0")])
    """
    xs = [float(x) for line in lines for x, y in line.points if _finite(y)]
    xs += [float(m.step) for m in markers if xs]
    ys = [float(y) for line in lines for _, y in line.points if _finite(y)]
    if not ys:
        return '<p class="muted">no steps recorded</p>'
    left, right, top, bottom = 56, 12, 10, 26
    x0, y0 = min(xs), min(ys)
    x1, y1 = max(*xs, x0 + 1), max(*ys, y0 + 1e-12)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom)

    base = height - bottom
    parts = [
        f'<line x1="{left}" y1="{base}" x2="{width - right}" y2="{base}" stroke="#999"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="#999"/>',
        _text(left - 4, sy(y0) + 4, f"{y0:.4g}", anchor="end"),
        _text(left - 4, sy(y1) + 4, f"{y1:.4g}", anchor="end"),
        _text(sx(x0), height - 8, f"step {x0:g}"),
        _text(sx(x1), height - 8, f"step {x1:g}", anchor="end"),
        *(_marker(m, i, sx(m.step), top, base, width) for i, m in enumerate(markers)),
        *(_path(line, sx, sy) for line in lines),
    ]
    legend = [
        f'<span style="color:{line.color}">{"╌" if line.dashed else "━"} {_e(line.label)}</span>'
        for line in lines
        if any(_finite(y) for _, y in line.points)
    ] + [f'<span style="color:{m.color}">┆ {_e(m.legend)}</span>' for m in markers]
    return _svg(width, height, "".join(parts), "line chart") + (
        f'<p class="legend">{" &nbsp; ".join(legend)}</p>'
    )


def _path(line: Line, sx: Callable[[float], float], sy: Callable[[float], float]) -> str:
    """The line as one path (a new M after each gap), with its dots if asked."""
    d, pen_down, dots = [], False, []
    for x, y in line.points:
        if not _finite(y):
            pen_down = False
            continue
        px, py = sx(x), sy(y)
        d.append(f"{'L' if pen_down else 'M'}{px:.1f},{py:.1f}")
        pen_down = True
        if line.dots:
            dots.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{line.color}"/>')
    dash = ' stroke-dasharray="5 3"' if line.dashed else ""
    return (
        f'<path class="{line.css_class}" d="{"".join(d)}" fill="none" stroke="{line.color}" '
        f'stroke-width="{line.width}"{dash}/>' + "".join(dots)
    )


def _marker(marker: Marker, index: int, x: float, top: float, base: float, width: int) -> str:
    """The marker's dotted line, its label at the foot (a resumed call's loss curve starts at
    the marker, high at the top) on the side with room, the labels of several stacked."""
    right_half = x > width / 2
    label = _text(
        x - 3 if right_half else x + 3,
        base - 4 - 12 * index,
        marker.label,
        anchor="end" if right_half else "start",
        fill=marker.color,
    )
    return (
        f'<g class="{marker.css_class}"><title>{_e(marker.legend)}</title>'
        f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{base}" stroke="{marker.color}" '
        f'stroke-width="1.5" stroke-dasharray="2 2"/>{label}</g>'
    )


def _loss_chart(loss: dict[str, Any], layout_changes: Sequence[dict[str, Any]] = ()) -> str:
    """Each rank's loss (thin), the global training loss, the evaluation loss (dashed) and a
    marker at each layout change."""
    steps = loss.get("steps") or []
    per_rank = loss.get("per_rank") or []
    lines = [
        Line(f"rank {r}", list(zip(steps, ys, strict=True)), RANK_COLORS[r % len(RANK_COLORS)])
        for r, ys in enumerate(per_rank)
        if len(per_rank) <= len(RANK_COLORS)  # beyond, a tangle no legend can name
    ]
    train = list(zip(steps, loss.get("global") or [], strict=True))
    lines.append(Line("train loss (global mean)", train, TRAIN_COLOR, 2.0, css_class="train-loss"))
    evals = [(e["step"], e["loss"]) for e in loss.get("eval") or [] if _finite(e.get("loss"))]
    if evals:
        dots = len(evals) <= MAX_DOTS
        lines.append(Line("eval loss", evals, EVAL_COLOR, 1.5, True, dots, "eval-loss"))
    return line_chart(lines, markers=[_layout_marker(c) for c in layout_changes])


def _layout_marker(change: dict[str, Any]) -> Marker:
    """``DDP() → FSDP()`` at the step where a resumed call moved the run to its strategy."""
    move = f"{change['from']} → {change['to']}"
    seconds = _seconds(change["seconds"])
    return Marker(
        change["step"], move, f"layout: {move} at step {change['step']} (moved in {seconds})"
    )


def _bar_rows(rows: Sequence[tuple[str, list[tuple[float, str]], str]], css_class: str) -> str:
    """One row per rank: ``(label, [(fraction 0..1, colour)...], text)``, the bars of a row
    drawn over each other in order; the text in its own cell, so a long one wraps."""
    width = 240
    cells = []
    for label, bars, text in rows:
        rects = [f'<rect width="{width}" height="12" fill="{TRACK_COLOR}"/>']
        rects += [
            f'<rect width="{width * min(1.0, max(0.0, fraction)):.1f}" height="12" fill="{color}"/>'
            for fraction, color in bars
        ]
        cells.append(
            f"<tr><td>{_e(label)}</td><td>{_svg(width, 12, ''.join(rects), 'bar')}</td>"
            f"<td>{_e(text)}</td></tr>"
        )
    return f'<table class="bars {css_class}">{"".join(cells)}</table>'


def _memory_chart(rows: list[dict[str, Any]]) -> str:
    top = max([1, *(max(r.get("peak") or 0, r.get("held") or 0) for r in rows)])
    bars = []
    for r in rows:
        phase = f" in {r['peak_phase']}" if r.get("peak_phase") else ""
        text = f"{_bytes(r.get('held'))} (peak {_bytes(r.get('peak'))}{phase})"
        if r.get("cuda_reserved") is not None:
            text += f" · reserved {_bytes(r['cuda_reserved'])}"
        if r.get("gpu_util") is not None:
            text += f" · util {r['gpu_util']}%"
        if r.get("rss_bytes"):
            text += f" · RSS {_bytes(r['rss_bytes'])}"
        fills = [((r.get("peak") or 0) / top, PEAK_COLOR), ((r.get("held") or 0) / top, HELD_COLOR)]
        bars.append((f"rank {r['rank']}", fills, text))
    legend = (
        f'<span style="color:{HELD_COLOR}">■ held</span> over '
        '<span style="color:#6baed6">■ peak</span>'
    )
    return _bar_rows(bars, "memory") + f'<p class="legend">{legend}</p>'


def _comm_chart(rows: list[dict[str, Any]]) -> str:
    bars = []
    for r in rows:
        kinds = [
            f"{kind} {_bytes(c['bytes'])} in {1000 * c['time_s']:.2f} ms"
            for kind, c in r["per_step"].items()
        ]
        text = f"{100 * r['share']:.0f}% of time · {' · '.join(kinds) or '–'}"
        bars.append((f"rank {r['rank']}", [(r["share"], COMM_COLOR)], text))
    return _bar_rows(bars, "communication")


# -- tables ------------------------------------------------------------------------------------


def _progress(p: dict[str, Any], *, frozen: bool) -> str:
    span = max(1, (p.get("total") or 0) - (p.get("start") or 0))
    done = min(1.0, max(0.0, ((p.get("step") or 0) - (p.get("start") or 0)) / span))
    eta = "done" if frozen else f"ETA {_seconds(p.get('eta_s'))}"
    text = (
        f"step {p.get('step', 0)} / {p.get('total', 0)} · {_seconds(p.get('elapsed_s'))} · "
        f"{eta} · {round(p.get('samples_per_s') or 0)} samples/s"
    )
    if p.get("loss") is not None:
        text += f" · loss {p['loss']:.4g}"
    if p.get("checkpoint"):
        text += f" · checkpoint at step {p['checkpoint']['step']}"
    text += "".join(f" · {note}" for note in p.get("notes") or [])
    return (
        f'<div class="progress"><div style="width:{100 * done:.1f}%"></div></div><p>{_e(text)}</p>'
    )


def _status_table(ranks: list[dict[str, Any]]) -> str:
    body = "".join(
        f'<tr><td class="num">{r["rank"]}</td>'
        f'<td style="background:{STATUS_COLORS.get(r["status"], "#eee")}">{_e(r["status"])}</td>'
        f'<td class="error">{_e(r.get("error") or "")}</td></tr>'
        for r in ranks
    )
    return (
        f'<table class="statuses"><tr><th>rank</th><th>status</th><th>error</th></tr>{body}</table>'
    )


def _evals_table(evals: list[dict[str, Any]]) -> str:
    if not evals:
        return ""
    shown = evals[-EVAL_ROWS:]
    keys = list(dict.fromkeys(k for e in shown for k in e))
    caption = "Evaluations" + (
        f" (latest {len(shown)} of {len(evals)})" if len(evals) > len(shown) else ""
    )
    return f"<h2>{caption}</h2>" + _table(keys, shown, "evals")


def _trace_table(traces: list[dict[str, Any] | None]) -> str:
    """One row per rank; a rank without a trace (None) gets an empty row."""
    rows = [{"rank": rank, **(trace or {})} for rank, trace in enumerate(traces)]
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "path"))
    paths = [row["path"] for row in rows if row.get("path")]
    where = f'<p class="muted">traces: {_e(_common_dir(paths))}</p>' if paths else ""
    return _table(keys, rows, "trace") + where


def _table(keys: list[str], rows: list[dict[str, Any]], css_class: str) -> str:
    head = "".join(f"<th>{_e(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(k, row.get(k))}</td>" for k in keys) + "</tr>" for row in rows
    )
    return f'<table class="{css_class}"><tr>{head}</tr>{body}</table>'


def _cell(key: str, value: Any) -> str:
    """A table cell: list items one per line, a step range as ``5-7``, shares as percentages,
    floats short."""
    if key == "steps" and isinstance(value, list | tuple) and len(value) == 2:
        return _e(f"{value[0]}-{value[1]}")
    if isinstance(value, list | tuple):
        return "<br>".join(_e(_item(v)) for v in value)
    if isinstance(value, float):
        return _e(f"{100 * value:.1f}%" if key.endswith("share") else f"{value:.4g}")
    return _e("–" if value is None else str(value))


def _item(value: Any) -> str:
    """``(name, self_ms)`` as ``name 1.25 ms``; anything else as it prints."""
    if isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[1], int | float):
        return f"{value[0]} {value[1]:.2f} ms"
    return str(value)


def _common_dir(paths: list[str]) -> str:
    """Where the trace files are: their common directory (or the one path)."""
    return paths[0] if len(paths) == 1 else os.path.commonpath([os.path.dirname(p) for p in paths])


# -- small pieces ------------------------------------------------------------------------------


def _section(heading: str, body: str) -> str:
    return f"<section><h2>{_e(heading)}</h2>{body}</section>"


def _svg(width: int, height: int, body: str, css_class: str) -> str:
    return (
        f'<svg class="{css_class}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">{body}</svg>'
    )


def _text(
    x: float, y: float, text: str, *, anchor: str = "start", fill: str = "#555", size: int = 10
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}" '
        f'font-size="{size}" font-family="sans-serif">{_e(text)}</text>'
    )


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


def _finite(value: Any) -> TypeIs[float]:
    return isinstance(value, int | float) and math.isfinite(value)


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    units, i, value = ("B", "KiB", "MiB", "GiB", "TiB"), 0, float(n)
    while abs(value) >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.{1 if i else 0}f} {units[i]}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 60:
        return f"{s:.1f} s"
    m = int(s // 60)
    return f"{m} min {round(s % 60)} s" if m < 60 else f"{m // 60} h {m % 60} min"
