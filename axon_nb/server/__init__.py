"""Jupyter server extension (and JupyterLab extension) of axon_nb: the Axon sidebar's data.

Enabled on install (``jupyter-config/jupyter_server_config.d/axon_nb.json``); see
``axon_nb.server.handlers`` for the routes and ``axon_nb.server.registry`` for where the
data comes from.

Example::

    jupyter server extension list    # axon_nb.server enabled, OK
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "axon_nb.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "../labextension", "dest": "axon-nb"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the handlers (called by the Jupyter server at start)."""
    from axon_nb.server.handlers import setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("axon_nb.server: Axon sidebar API at /axon-nb/clusters")
