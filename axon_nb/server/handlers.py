"""The Axon sidebar's REST API, behind the Jupyter server's own authentication (its token or
cookie, and XSRF for POST), as every other JupyterLab API is. No new port.

- ``GET  /axon-nb/clusters``                 -> ``{"clusters": [state, ...]}``
- ``GET  /axon-nb/clusters/<key>``           -> one cluster's state
- ``POST /axon-nb/clusters/<key>/<action>``  -> 202 ``{"queued": true}`` (``stop_run``,
  ``interrupt``, ``restart``, ``stop_cluster``)

Example::

    curl -H "Authorization: token $TOKEN" http://localhost:8888/axon-nb/clusters
"""

from __future__ import annotations

import json
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from axon_nb.server.registry import RegistryError, get_cluster, list_clusters, request


class _RegistryHandler(APIHandler):
    def _answer(self, status: int, body: dict[str, Any]) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))

    def _fail(self, error: RegistryError) -> None:
        self._answer(error.status, {"message": str(error)})


class ClustersHandler(_RegistryHandler):
    @tornado.web.authenticated
    def get(self) -> None:
        try:
            self._answer(200, {"clusters": list_clusters()})
        except RegistryError as e:
            self._fail(e)


class ClusterHandler(_RegistryHandler):
    @tornado.web.authenticated
    def get(self, key: str) -> None:
        try:
            self._answer(200, get_cluster(key))
        except RegistryError as e:
            self._fail(e)


class ControlHandler(_RegistryHandler):
    @tornado.web.authenticated
    def post(self, key: str, action: str) -> None:
        try:
            request(key, action)
        except RegistryError as e:
            self._fail(e)
            return
        self._answer(202, {"queued": True, "action": action})


def setup_handlers(web_app: Any) -> None:
    """Add the routes under the server's base URL."""
    base = url_path_join(web_app.settings["base_url"], "axon-nb", "clusters")
    web_app.add_handlers(
        ".*$",
        [
            (base, ClustersHandler),
            (url_path_join(base, r"([A-Za-z0-9_-]+)"), ClusterHandler),
            (url_path_join(base, r"([A-Za-z0-9_-]+)", r"([a-z_]+)"), ControlHandler),
        ],
    )
