"""A pytest plugin that writes when each test ran, to see what ran beside a slow test.

Loaded by conftest.py when ``AXON_TEST_TIMELINE`` names a file: each worker appends one line
per test, ``worker start_s end_s load_1min cpu_s nodeid`` (times in seconds since the epoch;
``cpu_s``: the CPU seconds the worker and every process below it used during the test, ranks,
kernels and servers included, so a test's cost shows even beside other workers)::

    AXON_TEST_TIMELINE=/tmp/timeline.txt make test
    sort -k2 -n /tmp/timeline.txt
    sort -k5 -rn /tmp/timeline.txt | head  # the costliest tests
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

_started: dict[str, tuple[float, float]] = {}
_plugins: list[pytest.PytestPluginManager] = []


def pytest_configure(config: pytest.Config) -> None:
    _plugins.append(config.pluginmanager)


def _in_xdist_controller() -> bool:
    """pytest-xdist's controller sees every worker's tests too: it writes none. (Its
    ``dsession`` plugin is registered in xdist's own pytest_configure, which may run after
    this module's: it is asked per test.)"""
    return _plugins[0].hasplugin("dsession")


def _tree_cpu() -> float:
    """CPU seconds of this process and its descendants, those they have reaped included (an
    exited process's time goes to its parent once reaped)."""
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started[nodeid] = (time.time(), _tree_cpu())


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _in_xdist_controller():
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    started, cpu = _started.pop(nodeid, (0.0, 0.0))
    line = (
        f"{worker} {started:.1f} {time.time():.1f} "
        f"{os.getloadavg()[0]:.1f} {_tree_cpu() - cpu:.1f} {nodeid}\n"
    )
    with open(os.environ["AXON_TEST_TIMELINE"], "a") as f:
        f.write(line)
