"""The dashboard fed with a recorded metrics stream (2 ranks, ``recorded_stream.py``): widget
state, throttling, evaluation points, layout changes, export."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from recorded_stream import EVAL_EVERY, MOVE, STREAM, with_evals, with_layout_change

from axon_nb.train.result import build_result
from axon_nb.widgets._state import DashboardState
from axon_nb.widgets.dashboard import Dashboard


def _feed(dashboard: Dashboard, run: dict[str, Any]) -> None:
    for rank, message in run["messages"]:
        dashboard.message(rank, message)
    dashboard.done({int(r): e for r, e in (run["failures"] or {}).items()})


def test_a_finished_run_shows_progress_loss_memory_and_communication() -> None:
    run = STREAM["finished"]
    dashboard = Dashboard(2, title="model")
    _feed(dashboard, run)
    assert dashboard.progress["step"] == dashboard.progress["total"] == 120
    assert dashboard.progress["eta_s"] == 0.0 and dashboard.progress["samples_per_s"] > 0
    assert [r["status"] for r in dashboard.ranks] == ["finished", "finished"]
    assert dashboard.loss["steps"] == list(range(1, 121))
    assert dashboard.loss["global"] == pytest.approx(run["losses"])
    assert len(dashboard.loss["per_rank"]) == 2 and None not in dashboard.loss["per_rank"][1]
    for row in dashboard.memory:
        assert row["held"] == row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
        assert row["peak"] >= row["held"] > 0 and row["rss_bytes"] > 0
    for row in dashboard.communication:
        assert row["per_step"]["all_reduce"]["bytes"] > 0 and 0 < row["share"] < 1
    assert dashboard.frozen


def test_updates_are_throttled_however_fast_messages_arrive() -> None:
    dashboard = Dashboard(2)
    _feed(dashboard, STREAM["finished"])  # 18 publications delivered in a burst
    assert dashboard.updates <= 3  # the first one, maybe one more, and the final sync


def test_a_rank_failing_mid_run_shows_as_failed_with_its_error() -> None:
    dashboard = Dashboard(2)
    _feed(dashboard, STREAM["failed"])
    by_rank = {r["rank"]: r for r in dashboard.ranks}
    assert by_rank[1]["status"] == "failed"
    assert "FloatingPointError: loss diverged on rank 1" in by_rank[1]["error"]
    assert dashboard.progress["step"] < 120  # frozen where it stopped


def test_a_silent_running_rank_is_shown_stalled() -> None:
    state = DashboardState(2, stall_after_s=5)
    first = STREAM["finished"]["messages"][0]
    message = {**first[1], "status": "running", "heartbeat": 1000.0}
    state.update(0, message)
    assert state.status(0, now=1003.0) == "running"
    assert state.status(0, now=1006.0) == "stalled"
    assert state.status(1, now=1006.0) == "waiting"


def test_long_runs_keep_a_bounded_series() -> None:
    state = DashboardState(1, max_points=10)
    for step in range(1, 101):
        record = {"step": step, "loss": 1 / step, "rank_loss": 1 / step, "samples_per_s": 1}
        state.update(0, {"status": "running", "heartbeat": 0, "records": [record]})
    assert len(state.steps) <= 20 and state.steps[-1] in (99, 100)
    assert set(state.rank_loss[0]) <= set(state.steps)  # per-rank losses are thinned too


def test_evaluations_reach_the_synced_state_and_the_incremental_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("axon_nb.widgets.dashboard.UPDATE_S", 0.0)  # every message refreshes
    monkeypatch.setattr("axon_nb.widgets.dashboard.FULL_SYNC_S", 1e9)  # incrementally
    run = with_evals(STREAM["finished"])
    dashboard = Dashboard(2)
    sent: list[dict[str, Any]] = []
    dashboard.send = sent.append  # type: ignore[method-assign]
    for rank, message in run["messages"]:
        dashboard.message(rank, message)
    appended = [e for m in sent for e in m["evals"]]
    steps = list(range(EVAL_EVERY, 121, EVAL_EVERY))
    assert [e["step"] for e in appended] == steps  # each once, though both ranks report it
    assert all(m["type"] == "append" for m in sent)
    dashboard.done({})
    evals = dashboard.loss["eval"]
    assert [e["step"] for e in evals] == steps
    assert evals[0] == {"step": 20, **_record(run, 20)["eval"]}
    assert dashboard.loss["global"] == pytest.approx(run["losses"])  # training loss unchanged


def test_records_without_evaluations_show_none() -> None:
    dashboard = Dashboard(2)
    _feed(dashboard, STREAM["finished"])
    assert dashboard.loss["eval"] == [] and dashboard.trace_summary == []


def test_long_runs_keep_a_bounded_list_of_evaluations() -> None:
    state = DashboardState(1, max_points=10)
    for step in range(1, 101):
        record = {"step": step, "loss": 1.0, "rank_loss": 1.0, "samples_per_s": 1,
                  "eval": {"loss": 2.0, "samples": 8}}  # fmt: skip
        state.update(0, {"status": "running", "heartbeat": 0, "records": [record]})
    assert len(state.evals) <= 20 and max(state.evals) == 100


def _record(run: dict[str, Any], step: int) -> dict[str, Any]:
    return next(r for _, m in run["messages"] for r in m["records"] if r["step"] == step)


def test_static_exports_html_and_a_png_with_the_eval_curve(tmp_path: Path) -> None:
    run = with_evals(STREAM["finished"])
    dashboard = Dashboard(2, title="exported run")
    _feed(dashboard, run)
    html = dashboard.save(tmp_path / "run.html").read_text()  # tests/test_dashboard_export.py
    assert "exported run" in html and "<script" not in html and 'class="eval-loss"' in html

    summaries = _summaries(run)
    result = build_result(summaries, name="model", strategy="DDP()")
    assert [e["step"] for e in result.evals] == list(range(EVAL_EVERY, 121, EVAL_EVERY))
    png = tmp_path / "run.png"
    figure = result.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["eval loss"].get_xdata()) == [e["step"] for e in result.evals]
    assert list(lines["eval loss"].get_ydata()) == pytest.approx([e["loss"] for e in result.evals])
    assert len(lines["train loss (global mean)"].get_xdata()) == 120


def test_a_plot_without_evaluations_has_no_eval_line() -> None:
    result = build_result(_summaries(STREAM["finished"]), name="model", strategy="DDP()")
    labels = [line.get_label() for line in result.plot().axes[0].get_lines()]
    assert "eval loss" not in labels and "train loss (global mean)" in labels


def _summaries(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-rank summaries as the ranks return them, rebuilt from the last publications."""
    last: dict[int, dict[str, Any]] = {}
    records: dict[int, dict[int, dict[str, Any]]] = {0: {}, 1: {}}
    for rank, message in run["messages"]:
        last[rank] = message
        records[rank].update({r["step"]: r for r in message["records"]})
    return [{**last[r], "device": "cpu", "records": list(records[r].values())} for r in (0, 1)]


def test_a_rank_that_goes_silent_turns_stalled_without_new_messages() -> None:
    import time

    board = Dashboard(1)
    message = {**STREAM["finished"]["messages"][0][1], "status": "running"}
    board.message(0, {**message, "heartbeat": time.time() - 60})  # last heard a minute ago
    board._last_update = float("-inf")  # as if IDLE_REFRESH_S had passed
    board.tick()
    assert board.ranks[0]["status"] == "stalled"


def test_a_layout_change_is_marked_once_in_the_synced_state_the_export_and_the_plot(
    tmp_path: Path,
) -> None:
    run = with_layout_change(STREAM["finished"])
    dashboard = Dashboard(2, title="resumed")
    _feed(dashboard, run)
    assert dashboard.layout_changes == [MOVE]  # once, though every publication repeats it
    assert dashboard.loss["steps"][0] == MOVE["step"] + 1  # the curve starts right after it

    page = dashboard.save(tmp_path / "run.html").read_text()
    [mark] = re.findall(r'<g class="layout-change">.*?</g>', page)
    x = float(re.search(r'<line x1="([\d.]+)"', mark).group(1))  # type: ignore[union-attr]
    assert x == 56.0  # the chart's left edge: the call's first step is the marker's
    assert "DDP() → FSDP()</text>" in mark and "<title>layout: DDP() → FSDP() at step 0" in mark
    assert "┆ layout: DDP() → FSDP() at step 0 (moved in 2.0 s)" in page  # the legend

    result = build_result(_summaries(run), name="model", strategy="FSDP()")
    assert result.layout_change == MOVE
    axes = result.plot(tmp_path / "run.png").axes[0]
    marker = next(line for line in axes.get_lines() if "DDP() → FSDP()" in line.get_label())
    assert list(marker.get_xdata()) == [0, 0]
    assert marker.get_label() == "DDP() → FSDP() at step 0 (2.0 s)"
    assert [t.get_text() for t in axes.texts] == ["DDP() → FSDP()"]
    assert "DDP() → FSDP() at step 0" in [t.get_text() for t in axes.get_legend().get_texts()][-1]


def test_several_layout_changes_are_each_marked_in_step_order() -> None:
    state = DashboardState(1)
    later = {"step": 40, "from": "FSDP()", "to": "DDP()", "seconds": 0.5}
    for change, step in ((later, 41), (MOVE, 1), (later, 42)):  # as a follower might get them
        record = {"step": step, "loss": 1.0, "rank_loss": 1.0, "samples_per_s": 1}
        state.update(0, {"status": "running", "heartbeat": 0, "records": [record],
                         "layout_change": change})  # fmt: skip
    assert state.layout_changes == [MOVE, later]


def test_a_run_without_a_layout_change_shows_no_marker(tmp_path: Path) -> None:
    run = copy.deepcopy(STREAM["finished"])
    for _, message in run["messages"]:
        message["layout_change"] = None  # what a call that kept its layout publishes
    dashboard = Dashboard(2)
    _feed(dashboard, run)
    assert dashboard.layout_changes == []
    assert "layout-change" not in dashboard.save(tmp_path / "run.html").read_text()
    result = build_result(_summaries(run), name="model", strategy="DDP()")
    assert result.layout_change is None
    axes = result.plot().axes[0]
    assert not axes.texts and all("→" not in line.get_label() for line in axes.get_lines())


def test_a_resized_run_shows_the_ranks_that_joined_and_left() -> None:
    """``cluster.resize`` during a run: the dashboard goes on (not frozen by the first
    world's end), notes the change, and keeps rows for ranks that left, marked so."""
    dashboard = Dashboard(2, title="model")
    first = STREAM["finished"]["messages"]
    for rank, message in first[: len(first) // 2]:
        dashboard.message(rank, message)
    dashboard.done({})  # (what a first world's end would do, were it not handed over)
    dashboard.resized(2, 4, 60)
    assert not dashboard.frozen
    assert "ranks 2-3 joined at step 60 (2 -> 4 ranks)" in dashboard.progress["notes"]
    assert [r["status"] for r in dashboard.ranks] == ["waiting"] * 4  # until they publish
    for rank, message in first[len(first) // 2 :]:
        dashboard.message(rank + 2, message)  # (the new world's ranks publish)
    rows = dashboard.state.snapshot()["ranks"]  # (the widget's copy is throttled)
    assert [r["status"] for r in rows][2:] == ["finished", "finished"]
    dashboard.resized(4, 1, 120)
    statuses = [r["status"] for r in dashboard.ranks]
    assert statuses == ["waiting", "left", "left", "left"]
    assert "ranks 1-3 left at step 120 (4 -> 1 ranks)" in dashboard.progress["notes"]
    assert len(dashboard.loss["per_rank"]) == 4 and len(dashboard.memory) == 4
