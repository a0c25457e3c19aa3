"""End to end in a real browser: JupyterLab on loopback, Chromium driven by Playwright, the
example notebook training on 2 ranks while the dashboard's step counter and chart advance.

Needs the Debian ``chromium`` package and ``playwright`` + ``jupyterlab`` (the ``browser``
extra); skipped, saying which is missing, where they are not installed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import until
from lab_server import ARTIFACTS, CHROMIUM, ROOT, command, jupyter_lab, missing, notebook_page

MISSING = missing()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}"),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JupyterLab server on loopback over a copy of the example; yields the notebook's URL."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "examples" / "dashboard.ipynb", root)  # the repo's copy stays untouched
    with jupyter_lab(root, "jupyterlab.log") as (base, token):
        yield f"{base}/lab/tree/dashboard.ipynb?token={token}"


def test_dashboard_renders_and_advances_while_training(lab: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            with notebook_page(browser, lab) as page:
                command(page, "notebook:run-all-cells")
                _watch_and_interrupt(page)
        finally:
            browser.close()


def _watch_and_interrupt(page: Any) -> None:
    """The dashboard advances while training; an interrupt freezes every rank at one step."""
    step = page.locator(".axon-progress-text")
    step.wait_for(timeout=120_000)  # the cluster starts, then training shows its dashboard
    page.wait_for_function(
        "Number(document.querySelector('.axon-progress-text').dataset.step) > 0",
        timeout=60_000,
    )
    first = int(step.get_attribute("data-step"))
    first_points = _points(page)
    page.wait_for_function(  # (the widget redraws at most twice a second, later under load)
        f"Number(document.querySelector('.axon-progress-text').dataset.step) > {first}",
        timeout=60_000,
    )
    until(lambda: _points(page) > first_points, 60, every=0.2)
    later = int(step.get_attribute("data-step"))
    assert later > first, "the step counter did not advance"
    assert _points(page) > first_points, "the loss chart did not advance"
    assert page.locator(".axon-chart path.axon-loss-line").count() == 1
    assert page.locator(".axon-chip.axon-running").count() == 2
    dashboard = page.locator(".axon-dashboard")
    dashboard.scroll_into_view_if_needed()
    dashboard.screenshot(path=str(ARTIFACTS / "dashboard-running.png"))

    # Interrupting the kernel stops every rank at one step; the dashboard freezes there.
    command(page, "kernelmenu:interrupt")
    page.wait_for_selector(".axon-chip.axon-stopped >> nth=1", timeout=60_000)
    stopped = int(step.get_attribute("data-step"))
    assert later <= stopped < 3000 and "done" in step.inner_text()
    dashboard.screenshot(path=str(ARTIFACTS / "dashboard-stopped.png"))


def _points(page: object) -> int:
    """Loss points drawn so far (the dashboard counts appended ones on its root)."""
    value = page.evaluate(  # type: ignore[attr-defined]
        "(() => { const p = document.querySelector('.axon-loss-line');"
        " return p ? p.getAttribute('d').split('L').length : 0; })()"
    )
    return int(value)
