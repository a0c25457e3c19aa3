"""The Axon sidebar end to end in a real browser: JupyterLab on loopback with the extension as
installed, Chromium driven by Playwright. A notebook starts a 2-rank cluster and a run; the
sidebar lists them and the run advances; its dashboard opens in a tab; "Stop run" stops every
rank at one step boundary; "Stop cluster" makes the entry vanish. Screenshots of the sidebar
in the light and dark themes go to ``build/test-artifacts/``. The notebook dashboard widget
also renders and advances in Notebook 7.

Skipped, saying which is missing, without Debian's chromium, playwright, jupyterlab or
notebook.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab_server import ARTIFACTS, CHROMIUM, ROOT, command, jupyter_lab, missing, notebook_page

MISSING = missing("notebook")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.cluster,
    pytest.mark.timeout(420),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}"),
]

CELLS = [
    "%load_ext axon_nb\n%axon_cluster 2",
    "import axon_nb\n"
    "from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset\n"
    "handle = axon_nb.current_cluster().train(\n"
    "    model=lambda: GPT(GPTConfig(n_layer=2)), data=token_dataset, loss=lm_loss,\n"
    "    steps=100_000, batch_size=16, block=False)",
]


RUNTIME: dict[str, str] = {}
"""The server's Jupyter runtime directory (where the sidebar's registry is)."""

DETACHED = """
import os, sys
import axon_nb
from models import make_data, make_mlp, slow_mse
cluster = axon_nb.Cluster(n=2, detach=True, name=sys.argv[1]).start()
run = cluster.train(model=make_mlp, data=make_data(), loss=slow_mse(0.05), steps=100_000,
                    batch_size=32, block=False)
while not run.history:  # (the run has reached the ranks)
    import time; time.sleep(0.05)
os._exit(0)  # the script ends (as a notebook's kernel may): the cluster and its run go on
"""


def _notebook(path: Path, cells: list[str]) -> None:
    path.write_text(json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                   "source": c} for c in cells],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }))  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """JupyterLab (and Notebook 7, same server) on loopback; yields (base URL, token)."""
    root = tmp_path_factory.mktemp("lab")
    _notebook(root / "sidebar.ipynb", CELLS)
    shutil.copy(ROOT / "examples" / "dashboard.ipynb", root)
    runtime = {"JUPYTER_RUNTIME_DIR": str(root / "runtime")}
    RUNTIME.update(runtime)
    with jupyter_lab(root, "jupyterlab-sidebar.log", runtime) as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def test_sidebar_lists_controls_and_forgets_a_cluster(
    server: tuple[str, str], browser: Any
) -> None:
    base, token = server
    url = f"{base}/lab/tree/sidebar.ipynb?token={token}"
    with notebook_page(browser, url) as page:
        try:
            _use_the_sidebar(page)
        finally:
            page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme',"
                          " {theme: 'JupyterLab Light'})")  # fmt: skip


def _use_the_sidebar(page: Any) -> None:
    """List, watch, open, stop the run, stop the cluster, insert a cell (see the module)."""
    command(page, "axon-nb:open-sidebar")
    page.wait_for_selector("#axon-nb-sidebar .axon-nb-empty", timeout=30_000)
    command(page, "notebook:run-all-cells")

    run = page.locator("#axon-nb-sidebar .axon-nb-run[data-state=running]")
    run.wait_for(timeout=180_000)  # the cluster starts, then the run publishes
    cluster = page.locator("#axon-nb-sidebar .axon-nb-cluster")
    assert cluster.count() == 1
    meta = cluster.locator(".axon-nb-meta").first.inner_text()
    assert "2 ranks" in meta and "gloo" in meta and "cpu" in meta
    assert cluster.locator(".axon-nb-memory .axon-nb-row").count() == 2
    first = int(run.get_attribute("data-step"))
    page.wait_for_function(
        f"Number(document.querySelector('.axon-nb-run').dataset.step) > {first}",
        timeout=60_000,
    )  # it advances, live
    assert page.locator(".axon-nb-spark polyline").count() == 1
    assert "2 ranks" in page.locator(".axon-nb-statusbar").inner_text()
    sidebar = page.locator("#axon-nb-sidebar")
    sidebar.screenshot(path=str(ARTIFACTS / "sidebar-light.png"))
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme',"
                  " {theme: 'JupyterLab Dark'})")  # fmt: skip
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    time.sleep(1)
    sidebar.screenshot(path=str(ARTIFACTS / "sidebar-dark.png"))

    # the run's full dashboard in a main-area tab: the notebook widget's own view
    page.locator(".axon-nb-open").click()
    page.wait_for_selector(".axon-nb-dashboard-tab .axon-progress-text", timeout=30_000)
    assert page.locator(".axon-nb-dashboard-tab .axon-chip.axon-running").count() == 2

    # Stop run, confirmed: every rank stops at the same step
    page.locator(".axon-nb-control[data-action=stop_run]").click()
    page.locator(".jp-Dialog .jp-mod-warn").click()
    page.wait_for_selector(".axon-nb-run[data-state=stopped]", timeout=60_000)
    page.wait_for_selector(".axon-nb-dashboard-tab .axon-chip.axon-stopped >> nth=1",
                           timeout=30_000)  # fmt: skip
    sidebar.screenshot(path=str(ARTIFACTS / "sidebar-stopped-dark.png"))

    # Stop cluster, confirmed: its entry vanishes
    page.locator(".axon-nb-control[data-action=stop_cluster]").click()
    page.locator(".jp-Dialog .jp-mod-warn").click()
    page.wait_for_selector("#axon-nb-sidebar .axon-nb-empty", timeout=60_000)
    assert page.locator("#axon-nb-sidebar .axon-nb-cluster").count() == 0

    # a %axon_cluster cell is inserted into the active notebook
    cells = page.locator(".jp-Notebook .jp-Cell").count()
    command(page, "axon-nb:insert-cluster-cell")
    page.wait_for_function(f"document.querySelectorAll('.jp-Notebook .jp-Cell').length > {cells}")
    assert "%axon_cluster 2" in page.locator(".jp-Notebook .jp-Cell.jp-mod-active").inner_text()


def test_dashboard_widget_renders_and_advances_in_notebook_7(
    server: tuple[str, str], browser: Any
) -> None:
    base, token = server
    url = f"{base}/notebooks/dashboard.ipynb?token={token}"
    with notebook_page(browser, url, ready_ms=60_000, settle_s=3, lab=False) as page:
        command(page, "notebook:run-all-cells")
        step = page.locator(".axon-progress-text")
        step.wait_for(timeout=180_000)
        page.wait_for_function(
            "Number(document.querySelector('.axon-progress-text').dataset.step) > 0",
            timeout=60_000,
        )
        first = int(step.get_attribute("data-step"))
        page.wait_for_function(
            f"Number(document.querySelector('.axon-progress-text').dataset.step) > {first}",
            timeout=60_000,
        )
        page.locator(".axon-dashboard").screenshot(path=str(ARTIFACTS / "notebook7-dashboard.png"))
        command(page, "kernelmenu:interrupt")
        page.wait_for_selector(".axon-chip.axon-stopped >> nth=1", timeout=60_000)


def test_sidebar_shows_a_detached_cluster_to_attach_to_and_stops_it(
    server: tuple[str, str], browser: Any
) -> None:
    """A detached cluster, whose kernel is gone, is listed by its keeper: its name, its run,
    a copyable ``%axon_attach NAME``; "Stop cluster" ends every process of it."""
    import psutil
    from helpers import wait_gone

    base, token = server
    name = f"side-{int(time.time())}"
    env = {**os.environ, **RUNTIME}
    started = subprocess.run([sys.executable, "-c", DETACHED, name], env=env, timeout=180,
                             capture_output=True, text=True)  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    record = json.loads(
        (Path(RUNTIME["JUPYTER_RUNTIME_DIR"]) / "axon-clusters" / name / "cluster.json").read_text()
    )
    pids = [*record["pids"].values(), *record["roots"], record["keeper_pid"]]
    with notebook_page(browser, f"{base}/lab/tree/sidebar.ipynb?token={token}") as page:
        command(page, "axon-nb:open-sidebar")
        entry = page.locator("#axon-nb-sidebar .axon-nb-cluster", has_text=f"detached · {name}")
        entry.wait_for(timeout=60_000)
        assert entry.locator(".axon-nb-attach").inner_text() == f"%axon_attach {name}"
        assert "no kernel attached" in entry.locator(".axon-nb-detached").inner_text()
        entry.locator(".axon-nb-run[data-state=running]").wait_for(timeout=60_000)
        assert entry.locator(".axon-nb-control[data-action=restart]").count() == 0
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        entry.locator(".axon-nb-copy-attach").click()
        assert page.evaluate("navigator.clipboard.readText()") == f"%axon_attach {name}"
        page.locator("#axon-nb-sidebar").screenshot(path=str(ARTIFACTS / "sidebar-detached.png"))
        entry.locator(".axon-nb-control[data-action=stop_cluster]").click()
        page.locator(".jp-Dialog .jp-mod-warn").click()
        entry.wait_for(state="detached", timeout=60_000)
    assert wait_gone([p for p in pids if psutil.pid_exists(p)], 15) == []
