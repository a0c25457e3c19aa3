"""dask's security settings both sides use: TLS from PEM text, and no HTTP routes.

The kernel's client and each rank's worker build their ``distributed.Security`` here from the
cluster's certificates (``cluster/dask_tls.py`` makes them); the controller's scheduler gets
the same settings from its environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import distributed

NO_HTTP_ROUTES: dict[str, list[str]] = {
    "distributed.scheduler.http.routes": [],
    "distributed.worker.http.routes": [],
}
"""dask serves call stacks, logs, metrics and health over plain HTTP even with its dashboard
off; with no routes its HTTP server answers 404 to everything."""


def security_from_pem(ca: str, cert: str, key: str, *, role: str) -> distributed.Security:
    """A ``Security`` requiring TLS, trusting only the authority ``ca``, showing ``cert`` and
    ``key`` as ``role`` (``scheduler``, ``worker`` or ``client``). Example::

        security = security_from_pem(ca, cert, key, role="worker")
    """
    from distributed import Security

    return Security(
        require_encryption=True,
        tls_ca_file=ca,
        **{f"tls_{role}_cert": cert, f"tls_{role}_key": key},
    )
