"""End to end in a real browser: JupyterLab on loopback, Chromium driven by Playwright, the
example notebook training on 2 ranks while the dashboard's step counter and chart advance.

Needs the Debian ``chromium`` package and ``playwright`` + ``jupyterlab`` (the ``browser``
extra); skipped, saying which is missing, where they are not installed.
"""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from axon_nb.rank.bootstrap import free_port

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = [
    name
    for name, present in (
        ("chromium (apt-get install chromium)", CHROMIUM),
        ("playwright", importlib.util.find_spec("playwright")),
        ("jupyterlab", importlib.util.find_spec("jupyterlab")),
    )
    if not present
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}"),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JupyterLab server on loopback over a copy of the example; yields the notebook's URL."""
    port, token = free_port(), secrets.token_hex(16)
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "examples" / "dashboard.ipynb", root)  # the repo's copy stays untouched
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = (ARTIFACTS / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
         "--ServerApp.allow_root=True", f"--LabApp.workspaces_dir={root / 'workspaces'}",
         f"--LabApp.user_settings_dir={root / 'settings'}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _answers(f"{base}/api/status?token={token}"), 60, "JupyterLab to start")
        yield f"{base}/lab/tree/dashboard.ipynb?token={token}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_dashboard_renders_and_advances_while_training(lab: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(lab)
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')")
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-Toolbar", timeout=60_000)
            time.sleep(2)  # let the kernel connect
            _command(page, "notebook:run-all-cells")

            step = page.locator(".axon-progress-text")
            step.wait_for(timeout=120_000)  # the cluster starts, then training shows its dashboard
            page.wait_for_function(
                "Number(document.querySelector('.axon-progress-text').dataset.step) > 0",
                timeout=60_000,
            )
            first = int(step.get_attribute("data-step"))
            first_points = _points(page)
            time.sleep(3)
            later = int(step.get_attribute("data-step"))
            assert later > first, "the step counter did not advance"
            assert _points(page) > first_points, "the loss chart did not advance"
            assert page.locator(".axon-chart path.axon-loss-line").count() == 1
            assert page.locator(".axon-chip.axon-running").count() == 2
            dashboard = page.locator(".axon-dashboard")
            dashboard.scroll_into_view_if_needed()
            dashboard.screenshot(path=str(ARTIFACTS / "dashboard-running.png"))

            # Interrupting the kernel stops every rank at one step; the dashboard freezes there.
            _command(page, "kernelmenu:interrupt")
            page.wait_for_selector(".axon-chip.axon-stopped >> nth=1", timeout=60_000)
            stopped = int(step.get_attribute("data-step"))
            assert later <= stopped < 3000 and "done" in step.inner_text()
            dashboard.screenshot(path=str(ARTIFACTS / "dashboard-stopped.png"))
        finally:
            _command(page, "kernelmenu:shutdown")
            browser.close()


def _command(page: object, command: str) -> None:
    """Start a JupyterLab command without waiting for it (run-all ends when the cells do)."""
    page.evaluate(f"() => {{ window.jupyterapp.commands.execute('{command}'); }}")  # type: ignore[attr-defined]


def _points(page: object) -> int:
    """Loss points drawn so far (the dashboard counts appended ones on its root)."""
    value = page.evaluate(  # type: ignore[attr-defined]
        "(() => { const p = document.querySelector('.axon-loss-line');"
        " return p ? p.getAttribute('d').split('L').length : 0; })()"
    )
    return int(value)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for(check: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds:.0f} s for {what}")
        time.sleep(0.5)
