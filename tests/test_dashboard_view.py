"""The dashboard's view (``axon_nb/widgets/_dashboard.js``) and the sidebar's sparkline
(``extension/lib/format.js``, built from ``extension/src/format.ts``) in Chromium, without
JupyterLab: each module is imported into a blank page and driven with what the kernel syncs.
Here: a layout change (``resume=True`` under another strategy) is marked on the loss chart,
also when it arrives after the chart was drawn, and on the sparkline.

Needs Debian's ``chromium`` and ``playwright``; skipped, saying which is missing, where they
are not installed (the sparkline also needs the built extension: ``make extension``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from lab_server import ARTIFACTS, CHROMIUM, ROOT, missing
from recorded_stream import MOVE, STREAM, with_layout_change

from axon_nb.widgets.dashboard import Dashboard

MISSING = missing()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}"),
]
VIEW = ROOT / "axon_nb" / "widgets" / "_dashboard.js"
CSS = VIEW.with_name("_dashboard.css")
FORMAT = ROOT / "extension" / "lib" / "format.js"
TRAITS = ("title", "progress", "ranks", "memory", "communication", "loss", "frozen",
          "hang_report", "trace_summary", "layout_changes")  # fmt: skip

RENDER = """async ([source, state]) => {
  // What the view needs of an anywidget model, as the sidebar's dashboard tab gives it.
  const callbacks = {};
  window.model = {
    state, get: (name) => window.model.state[name],
    on: (event, cb) => (callbacks[event] ??= []).push(cb),
    set(name, value) {
      this.state[name] = value;
      (callbacks[`change:${name}`] || []).forEach((cb) => cb());
    },
  };
  const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
  const root = document.createElement("div");
  document.body.append(root);
  (await import(url)).default.render({ model: window.model, el: root });
}"""


@pytest.fixture(scope="module")
def browser_page() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def _synced(run: dict[str, Any]) -> dict[str, Any]:
    """The widget's synced traits after the recorded run."""
    board = Dashboard(2, title="resumed")
    for rank, message in run["messages"]:
        board.message(rank, message)
    board.done({})
    return {name: getattr(board, name) for name in TRAITS}


def test_the_loss_chart_marks_a_layout_change_at_its_step(browser_page: Any) -> None:
    browser_page.set_content(
        f"<html><head><style>{CSS.read_text()}</style></head><body></body></html>"
    )
    state = _synced(with_layout_change(STREAM["finished"]))
    browser_page.evaluate(RENDER, [VIEW.read_text(), state])
    mark = browser_page.locator(".axon-chart g.axon-layout-change")
    assert mark.count() == 1 and mark.get_attribute("data-step") == str(MOVE["step"])
    assert mark.locator("text.axon-layout-label").text_content() == "DDP() → FSDP()"
    assert mark.locator("line").get_attribute("x1") == "48"  # the left edge: where the call began
    assert browser_page.locator(".axon-layout-text").text_content() == (
        "layout: DDP() → FSDP() at step 0 (moved in 2.0 s)"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser_page.locator(".axon-loss").screenshot(
        path=str(ARTIFACTS / "dashboard-layout-change.png")
    )


def test_a_layout_change_synced_after_the_chart_is_drawn_is_marked(browser_page: Any) -> None:
    browser_page.set_content("<html><body></body></html>")
    state = _synced(STREAM["finished"])
    assert state["layout_changes"] == []
    browser_page.evaluate(RENDER, [VIEW.read_text(), state])
    assert browser_page.locator(".axon-layout-change").count() == 0
    assert browser_page.locator(".axon-chart path.axon-loss-line").count() == 1
    browser_page.evaluate("(change) => window.model.set('layout_changes', [change])", MOVE)
    assert browser_page.locator(".axon-chart g.axon-layout-change").count() == 1


@pytest.mark.skipif(not FORMAT.exists(), reason="needs the built extension (make extension)")
def test_the_sidebar_sparkline_marks_a_layout_change_at_its_start(browser_page: Any) -> None:
    browser_page.set_content("<html><body></body></html>")
    marks = browser_page.evaluate(
        """async ([source, move]) => {
          const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
          const { sparkline } = await import(url);
          const points = Array.from({ length: 60 }, (_, i) => [1 + 2 * i, 1 / (1 + i)]);
          const draw = (at) => sparkline(points, [{ step: at, title: "DDP() → FSDP()" }]);
          const shown = draw(move.step).querySelectorAll("line.axon-nb-spark-mark");
          return {
            shown: [...shown].map((l) => [l.getAttribute("x1"), l.textContent]),
            inside: draw(61).querySelectorAll("line.axon-nb-spark-mark").length,
            long_before: draw(-500).querySelectorAll("line.axon-nb-spark-mark").length,
          };
        }""",
        [FORMAT.read_text(), MOVE],
    )
    assert marks["shown"] == [["1.0", "DDP() → FSDP()"]]  # the left edge, with its tooltip
    assert marks["inside"] == 1 and marks["long_before"] == 0  # off the drawn steps: no mark
