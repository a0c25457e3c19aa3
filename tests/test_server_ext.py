"""The server extension's handler tests (``tests/server_ext``), run under Jupyter Server's
pytest plugin in a pytest process of their own, and the extension's registration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).parent.parent


def test_handlers_under_jupyter_servers_pytest_plugin() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_jupyter.jupyter_server", "-q",
         "-p", "no:cacheprovider", "tests/server_ext"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_extension_points() -> None:
    import axon_nb.server as server

    assert server._jupyter_server_extension_points() == [{"module": "axon_nb.server"}]
    assert server._jupyter_labextension_paths()[0]["dest"] == "axon-nb"
