"""Each cluster's own certificate authority for its dask scheduler, workers and client.

dask authenticates nothing on a plain ``tcp://`` address: any process that reaches the
scheduler can run code on every worker (``Client.run``) as the cluster's owner. With TLS and
mutual authentication (``distributed.security.Security``), every connection must show a
certificate signed by the cluster's authority, so a client without the cluster's files is
refused during the handshake.

At a cluster's first ``cluster.dask()`` the kernel makes an authority and one certificate per
role (scheduler, worker, client) with ``cryptography``, into the cluster's owner-only
directory (``tls/``, files 0600): its EC P-256 keys take milliseconds, and no cluster start
pays for it. The controller's dask scheduler reads its files through the dask settings of its
environment (:func:`scheduler_environment`, fixed when the controller starts); each rank's
worker gets its certificate and key as text in the request that starts it (ipyparallel's
messages are encrypted with CurveZMQ), so ranks on other hosts need no file of the kernel's.
The authority's own key is never written: nothing can be signed after the first call.

Example::

    tls = cluster_tls(private_dir)
    tls.ensure()                 # makes the files once; raises naming a file gone missing
    security = tls.security("client")
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from axon_nb.errors import AxonError
from axon_nb.spec.dask_security import security_from_pem

if TYPE_CHECKING:
    import distributed
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

ROLES = ("scheduler", "worker", "client")
VALID_DAYS = 3650
"""Certificates outlive any cluster (a detached run may last weeks); they die with its files."""


class CertificateError(AxonError):
    """A certificate or key the cluster made is missing or unreadable."""


@dataclass(frozen=True)
class ClusterTLS:
    """The certificate files of one cluster, in ``directory`` (made owner-only)."""

    directory: Path

    def path(self, name: str) -> Path:
        """The file ``name`` (``ca.pem``, ``worker.pem``, ``worker-key.pem``...)."""
        return self.directory / name

    def files(self) -> list[Path]:
        """Every file the cluster's TLS needs."""
        return [
            self.path("ca.pem"),
            *(self.path(f"{role}{part}.pem") for role in ROLES for part in ("", "-key")),
        ]

    def made(self) -> bool:
        """Whether the files were made (the directory exists): from then on they must stay."""
        return self.directory.is_dir()

    def ensure(self) -> None:
        """Make the authority and certificates on first use; afterwards check that each file
        is still there and readable, raising :class:`CertificateError` naming the first that
        is not (and what to do)."""
        if not self.made():
            _write_certificates(self)
        for path in self.files():
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise CertificateError(
                    f"the cluster's dask certificate file {path} is missing or unreadable "
                    f"({e.strerror}). It is made at the cluster's first cluster.dask() and "
                    "must stay until the cluster stops: restart the cluster "
                    "(cluster.restart()) to make new certificates."
                ) from None

    def pem(self, role: str) -> tuple[str, str, str]:
        """The authority's certificate, and ``role``'s certificate and key, as text."""
        return (
            self.path("ca.pem").read_text(),
            self.path(f"{role}.pem").read_text(),
            self.path(f"{role}-key.pem").read_text(),
        )

    def security(self, role: str) -> distributed.Security:
        """The ``Security`` of ``role`` (``"client"`` for the kernel's client)."""
        return security_from_pem(*self.pem(role), role=role)


def cluster_tls(private_dir: Path) -> ClusterTLS:
    """The cluster's dask certificates, in its owner-only directory ``private_dir``."""
    return ClusterTLS(Path(private_dir) / "tls")


def scheduler_environment(tls: ClusterTLS, scratch: Path) -> dict[str, str]:
    """dask's settings, as environment variables, for the scheduler the controller starts:
    TLS required with the cluster's files (read when ``cluster.dask()`` starts it), no HTTP
    routes, and ``scratch`` (owner-only) instead of the shared ``dask-scratch-space``."""
    return {
        "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES": "[]",
        "DASK_TEMPORARY_DIRECTORY": str(scratch),
        "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(tls.path("ca.pem")),
        "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__CERT": str(tls.path("scheduler.pem")),
        "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__KEY": str(tls.path("scheduler-key.pem")),
    }


def _write_certificates(tls: ClusterTLS) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    tls.directory.mkdir(mode=0o700, parents=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "axon_nb cluster authority")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), valid)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(tls.path("ca.pem"), ca_cert.public_bytes(serialization.Encoding.PEM))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for role in ROLES:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"axon_nb dask {role}")])
        cert = (
            _builder(name, ca_name, key.public_key(), valid)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(tls.path(f"{role}.pem"), cert.public_bytes(serialization.Encoding.PEM))
        key_bytes = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write(tls.path(f"{role}-key.pem"), key_bytes)


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: CertificatePublicKeyTypes,
    valid: tuple[datetime.datetime, datetime.datetime],
) -> x509.CertificateBuilder:
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
    )


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
