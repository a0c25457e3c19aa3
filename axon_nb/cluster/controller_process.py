"""The process of a cluster's ipyparallel controller: ipyparallel's own controller, with
CurveZMQ *and* an HMAC key, writing only owner-only files.

ipyparallel encrypts and authenticates its ZeroMQ sockets with CurveZMQ when asked
(``IPController.enable_curve``), but then drops its HMAC key ("CurveZMQ protects against
replays") unless the key is set in its configuration. Here both are on: the key is made in
this process (never on a command line, where ``ps`` shows it to every user) and travels to
the engines and the kernel's client in ipyparallel's owner-only connection files and the
launch environment, with the controller's public CurveZMQ key. A subscriber without that
key completes no handshake, so it reads nothing the ranks print or publish.

The umask makes every file the controller writes (connection files, its log, a dask
scheduler's files) owner-only whatever the user's umask is.

Usage (what ``cluster/launchers.py`` configures as the controller's command)::

    python -m axon_nb.cluster.controller_process --ip=127.0.0.1 ...
"""

from __future__ import annotations

import os
import secrets


def main() -> None:
    """Run ipyparallel's controller with CurveZMQ, an HMAC key of this process's making and
    an owner-only umask (its arguments are ipyparallel's)."""
    os.umask(0o077)
    from ipyparallel.controller.app import IPController
    from traitlets.config import Config

    config = Config()
    config.Session.key = secrets.token_hex(32).encode("ascii")
    config.IPController.enable_curve = True
    IPController.launch_instance(config=config)


if __name__ == "__main__":
    main()
