"""``Dashboard.save`` writes one self-contained page: inline SVG charts and tables, no script,
nothing fetched. Chromium opens it with JavaScript off and the network refused, and the charts
are drawn (their SVG shapes, and their colours in a screenshot).

The browser part needs Debian's ``chromium`` and ``playwright``; it is skipped, saying which is
missing, where they are not installed.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from lab_server import ARTIFACTS, CHROMIUM, missing
from recorded_stream import EVAL_EVERY, STREAM, with_evals

from axon_nb.widgets import export
from axon_nb.widgets.dashboard import Dashboard

TRACE = [  # as result.traces holds them (rank order), and the handle hands them over
    {"path": "/runs/t/trace-rank0.json", "steps": [5, 7], "compute_ms": 40.0, "comm_ms": 10.6,
     "comm_share": 0.21, "top_ops": [["aten::mm", 12.5], ["c10d::allreduce_", 3.25]]},
    {"path": "/runs/t/trace-rank1.json", "steps": [5, 7], "compute_ms": 41.0, "comm_ms": 9.6,
     "comm_share": 0.19, "top_ops": [["aten::mm", 12.25]]},
]  # fmt: skip
MISSING = missing()


def exported(tmp_path: Path) -> Path:
    """The page of the recorded 2-rank run with evaluations and a trace summary."""
    board = Dashboard(2, title="exported <run>")
    for rank, message in with_evals(STREAM["finished"])["messages"]:
        board.message(rank, message)
    board.done({})
    board.trace_summary = TRACE  # what the handle does once the run ends
    return board.save(tmp_path / "run.html")


def test_the_page_is_self_contained_and_holds_every_chart(tmp_path: Path) -> None:
    path = exported(tmp_path)
    page = path.read_text()
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "@import" not in page and "url(" not in page  # nothing fetched from the CSS either
    assert "exported &lt;run&gt;" in page  # text is escaped
    for css_class in ("train-loss", "eval-loss", "bars memory", "bars communication"):
        assert f'class="{css_class}"' in page
    # one dot per evaluation (steps 20, 40, ..., 120) and a row each in the evaluations table
    assert page.count(f'fill="{export.EVAL_COLOR}"') == 120 // EVAL_EVERY
    assert "eval loss" in page and "accuracy" in page
    # the trace summary: its ops in ms and the communication share as a percentage
    assert "aten::mm 12.50 ms" in page and "21.0%" in page and "<td>5-7</td>" in page
    assert "traces: /runs/t" in page
    assert page.count("finished") >= 2  # the statuses table


def test_the_page_leaves_out_what_the_run_does_not_have(tmp_path: Path) -> None:
    board = Dashboard(2)
    for rank, message in STREAM["finished"]["messages"]:
        board.message(rank, message)
    page = board.save(tmp_path / "plain.html").read_text()
    assert 'class="train-loss"' in page
    assert "eval-loss" not in page and "Trace summary" not in page and "Evaluations" not in page
    board.trace_summary = [None, TRACE[1]]  # rank 0 wrote no trace
    assert "<tr><td>0</td><td>–</td>" in board.save(tmp_path / "part.html").read_text()
    empty = Dashboard(2).save(tmp_path / "empty.html").read_text()
    assert "no steps recorded" in empty and "<script" not in empty


@pytest.mark.timeout(120)
@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")
def test_chromium_draws_the_charts_with_javascript_off_and_no_network(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    path = exported(tmp_path)
    requested: list[str] = []
    with sync_playwright() as p:
        # A proxy that refuses everything, on top of the offline context: no request can leave.
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--proxy-server=127.0.0.1:9"]
        )
        try:
            context = browser.new_context(java_script_enabled=False, offline=True)
            page = context.new_page()
            page.on("request", lambda request: requested.append(request.url))
            page.goto(path.as_uri())
            charts = {
                "loss": page.locator("svg.line.chart"),
                "memory": page.locator("table.memory"),
                "communication": page.locator("table.communication"),
            }
            for chart in charts.values():
                assert chart.count() == 1 and chart.is_visible()
            assert page.locator("svg.line.chart path.eval-loss").count() == 1
            assert page.locator("svg.line.chart circle").count() == 120 // EVAL_EVERY
            train_d = page.locator("path.train-loss").get_attribute("d") or ""
            assert train_d.count("L") == 119  # one point per step, 120 steps
            assert page.locator("table.trace tr").count() == 1 + len(TRACE)
            shots = {name: chart.screenshot() for name, chart in charts.items()}
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-export.png"), full_page=True)
        finally:
            browser.close()
    assert requested == [path.as_uri()]
    assert _pixels(shots["loss"], export.TRAIN_COLOR) > 200
    assert _pixels(shots["loss"], export.EVAL_COLOR) > 50
    assert _pixels(shots["memory"], export.HELD_COLOR) > 200
    assert _pixels(shots["communication"], export.COMM_COLOR) > 20


def _pixels(png: bytes, color: str, tolerance: int = 40) -> int:
    """How many pixels of the screenshot are within ``tolerance`` of ``color`` (per channel)."""
    from PIL import Image

    target = tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(
        count
        for count, rgb in image.getcolors(maxcolors=1 << 20) or []
        if all(abs(a - b) <= tolerance for a, b in zip(rgb, target, strict=True))
    )


def test_the_memory_chart_says_which_phase_held_each_peak(tmp_path: Path) -> None:
    board = Dashboard(2, title="phases")
    for rank, message in STREAM["finished"]["messages"]:
        memory = {**(message.get("memory") or {}), "peak_phase": "step" if rank else "backward"}
        board.message(rank, {**message, "memory": memory})
    board.done({})
    page = board.save(tmp_path / "run.html").read_text()
    assert "in backward)" in page and "in step)" in page
    assert [r["peak_phase"] for r in board.memory] == ["backward", "step"]
