"""What the real-browser tests share: Debian's Chromium and what else they need, a JupyterLab
server on loopback (Notebook 7 is served by the same one), and how a page is driven.

Example::

    with jupyter_lab(root, "jupyterlab.log") as (base, token):
        page.goto(f"{base}/lab/tree/x.ipynb?token={token}")
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from helpers import until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def missing(*modules: str) -> list[str]:
    """What a browser test needs and is not installed: chromium, playwright, jupyterlab and
    ``modules``."""
    found = [("chromium (apt-get install chromium)", CHROMIUM)]
    found += [(m, importlib.util.find_spec(m)) for m in ("playwright", "jupyterlab", *modules)]
    return [name for name, present in found if not present]


@contextlib.contextmanager
def jupyter_lab(
    root: Path, log_name: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """JupyterLab over ``root`` on loopback, with the app exposed to page scripts; yields
    ``(base URL, token)`` and stops it afterwards. Its log goes to ``build/test-artifacts``."""
    token = secrets.token_hex(16)
    environment = {**os.environ, **(env or {})}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with (ARTIFACTS / log_name).open("w") as log:
        # Port 0: JupyterLab binds a port the system gives it and writes it to its runtime file.
        # (A port chosen here and closed again was once taken, in the seconds JupyterLab took
        # to start, by another worker's ipyparallel controller; JupyterLab moved to the next
        # port and the test talked HTTP to the controller's ZMQ socket.)
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             "--ServerApp.port=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
             "--JupyterNotebookApp.expose_app_in_browser=True",
             "--ServerApp.allow_root=True", f"--LabApp.workspaces_dir={root / 'workspaces'}",
             f"--LabApp.user_settings_dir={root / 'settings'}"],
            stdout=log, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
        info = Path(environment["JUPYTER_RUNTIME_DIR"]) / f"jpserver-{server.pid}.json"
        port: list[int] = []

        def read_port() -> bool:
            with contextlib.suppress(OSError, ValueError, KeyError):
                port.append(int(json.loads(info.read_text())["port"]))
            return bool(port)

        try:
            wait_for(read_port, 60, "JupyterLab to write its port")
            base = f"http://127.0.0.1:{port[0]}"
            wait_for(lambda: answers(f"{base}/api/status?token={token}"), 60, "JupyterLab to start")
            yield base, token
        finally:
            server.terminate()
            server.wait(timeout=30)


@contextlib.contextmanager
def notebook_page(
    browser: Any, url: str, *, ready_ms: float = 30_000, settle_s: float = 2, lab: bool = True
) -> Iterator[Any]:
    """A page on the notebook at ``url`` once the app and the notebook are there (within
    ``ready_ms``; in JupyterLab, ``lab``, also its toolbar) and its kernel has had
    ``settle_s`` to connect; the kernel is shut down and the page closed afterwards."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(url)
        page.wait_for_function(
            "window.jupyterapp && document.querySelector('.jp-Notebook')", timeout=ready_ms
        )
        if lab:  # (Notebook 7's first toolbar is a hidden side panel's)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-Toolbar", timeout=60_000)
        # The kernel is up and idle: a command sent before may find no kernel to run on.
        page.wait_for_function(
            "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status"
            " === 'idle'",
            timeout=max(ready_ms, 60_000),
        )
        time.sleep(settle_s)  # (and its comms, the widgets' among them, are open)
        yield page
    finally:
        command(page, "kernelmenu:shutdown")
        page.close()


def command(page: Any, name: str) -> None:
    """Start a JupyterLab command without waiting for it (run-all ends when the cells do)."""
    page.evaluate(f"() => {{ window.jupyterapp.commands.execute('{name}'); }}")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for(check: Any, seconds: float, what: str) -> None:
    if not until(check, seconds, every=0.5):
        raise TimeoutError(f"waited {seconds:.0f} s for {what}")
