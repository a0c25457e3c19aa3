"""These tests run under Jupyter Server's pytest plugin (``-p pytest_jupyter.jupyter_server``),
in a pytest process of their own that ``tests/test_server_ext.py`` starts: the plugin's
autouse fixtures would otherwise change the environment of every other test."""

from __future__ import annotations

import pytest


@pytest.fixture
def jp_server_config() -> dict:
    return {"ServerApp": {"jpserver_extensions": {"axon_nb.server": True}}}
