"""Every port a cluster's processes listen on: what speaks there and what protects it.

The one list of them (the README's Security section, ``Cluster.exposure`` and
``tests/test_security.py`` read it). On one host every port is on loopback; across hosts
the controller, the ranks' dask workers, gloo, MPI and the rendezvous store listen on the
ranks' network (``--iface``), and hydra's ``mpiexec`` on every interface.

What a stranger on this host or network got from each, probing every port found listening
(``tests/foreign_probe.py``): nothing from the protected ones; the exempt ones (marked
``exempt``) speak no protocol that runs code or serves data to a client that connects, and
are not authenticated: keep the ranks' network private.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ListeningPort:
    """One kind of port a cluster's process listens on."""

    process: str
    """Which process: ``controller``, ``rank`` (an engine or its nanny), ``mpiexec``,
    ``hydra proxy``."""
    speaks: str
    """The protocol and what it carries."""
    protection: str
    """What keeps strangers out (or, for an exempt port, why nothing is to be had)."""
    exempt: bool = False
    """Unauthenticated, carrying no request that runs code or reads data."""


PORTS: tuple[ListeningPort, ...] = (
    ListeningPort(
        "controller",
        "ZeroMQ: ipyparallel's registration, control, task, mux, IOPub, notification, "
        "broadcast and heartbeat sockets (code to run, results, every rank's output)",
        "CurveZMQ (encrypted; a client must know the controller's public key, which only "
        "the owner's 0600 connection files and the ranks' environment hold) and HMAC-SHA256 "
        "signatures with the cluster's key",
    ),
    ListeningPort(
        "controller",
        "dask scheduler (tls://, cluster.dask())",
        "TLS with mutual authentication: certificates signed by the cluster's own authority "
        "(made at the first cluster.dask(), owner-only files)",
    ),
    ListeningPort(
        "controller",
        "HTTP: the dask scheduler's web server",
        "loopback only; no routes (404 to everything) unless cluster.dask(dashboard=True), "
        "which serves dask's dashboard, unauthenticated, to this host's users",
    ),
    ListeningPort(
        "rank",
        "ZeroMQ: the nanny's control socket (signals to the engine)",
        "CurveZMQ and HMAC, as the controller's",
    ),
    ListeningPort(
        "rank",
        "dask worker (tls://)",
        "TLS with mutual authentication, as the scheduler's",
    ),
    ListeningPort(
        "rank",
        "HTTP: the dask worker's web server",
        "loopback only; no routes (404 to everything)",
    ),
    ListeningPort(
        "rank",
        "gloo (collectives between ranks)",
        "none: a connection that does not speak gloo's pair handshake is dropped; traffic "
        "is not encrypted",
        exempt=True,
    ),
    ListeningPort(
        "rank",
        "MPICH's libfabric TCP (MPI between ranks)",
        "none: unauthenticated, carries only MPI messages between ranks",
        exempt=True,
    ),
    ListeningPort(
        "rank",
        "torch.distributed TCPStore (rank 0, across hosts only: the world's rendezvous, "
        "and every process group and world re-form)",
        "none: unauthenticated; bound to the ranks' network (on one host the ranks meet "
        "through a file in the cluster's owner-only directory instead)",
        exempt=True,
    ),
    ListeningPort(
        "mpiexec",
        "hydra's control port for its proxies (across hosts only)",
        "none: unauthenticated; MPICH binds it on every interface and cannot narrow it",
        exempt=True,
    ),
    ListeningPort(
        "hydra proxy",
        "hydra's proxy (across hosts only: the ranks' PMI)",
        "none: unauthenticated",
        exempt=True,
    ),
)

_ROLES = (
    ("axon_nb.cluster.controller_process", "controller"),
    ("ipyparallel.controller", "controller"),
    ("axon_nb.rank.world.engine_server", "rank"),  # a forked engine or nanny
    ("axon_nb.rank.world.engine", "rank"),
    ("ipyparallel.engine.nanny", "rank"),
    ("axon_nb.rank.world.launch", "rank"),
    ("hydra_pmi_proxy", "hydra proxy"),
    ("mpiexec", "mpiexec"),
)


def role_of(command: str) -> str | None:
    """The :attr:`ListeningPort.process` a process with this command line is, or None.
    Example::

        role_of("python -m axon_nb.cluster.controller_process --ip=127.0.0.1")  # 'controller'
    """
    for needle, role in _ROLES:
        if needle in command:
            return role
    return None


def describe_ports() -> str:
    """The inventory as text, one port a line (what the README's Security section shows)."""
    return "\n".join(
        f"- {p.process}: {p.speaks}. {'Exempt: ' if p.exempt else 'Protected: '}{p.protection}."
        for p in PORTS
    )
