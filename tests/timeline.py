"""A pytest plugin that writes when each test ran, to see what ran beside a slow test.

Loaded by conftest.py when ``AXON_TEST_TIMELINE`` names a file: each worker appends one line
per test, ``worker start_s end_s load_1min nodeid`` (seconds since the epoch)::

    AXON_TEST_TIMELINE=/tmp/timeline.txt make test
    sort -k2 -n /tmp/timeline.txt
"""

from __future__ import annotations

import os
import time

import pytest

_started: dict[str, float] = {}
_plugins: list[pytest.PytestPluginManager] = []


def pytest_configure(config: pytest.Config) -> None:
    _plugins.append(config.pluginmanager)


def _in_xdist_controller() -> bool:
    """pytest-xdist's controller sees every worker's tests too: it writes none. (Its
    ``dsession`` plugin is registered in xdist's own pytest_configure, which may run after
    this module's: it is asked per test.)"""
    return _plugins[0].hasplugin("dsession")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _in_xdist_controller():
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = (
        f"{worker} {_started.pop(nodeid, 0.0):.1f} {time.time():.1f} "
        f"{os.getloadavg()[0]:.1f} {nodeid}\n"
    )
    with open(os.environ["AXON_TEST_TIMELINE"], "a") as f:
        f.write(line)
