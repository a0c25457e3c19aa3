"""A port for a new rendezvous (``MASTER_PORT``), free on this host when asked.

A port is picked by one process and listened on by another a moment later (rank 0's
``TCPStore``, or a script's ``init_process_group``). The usual pick, binding port 0, returns a
port of the range Linux hands to outgoing connections (``ip_local_port_range``), so any
connection opened meanwhile (a gloo pair, a ZeroMQ socket, another test) can take it first and
the rendezvous fails with ``EADDRINUSE`` (seen once in a full test run, for ``%axon_run``). A
port below that range is never handed out by the kernel: only a process that binds it by
number can take it.

Example::

    port = free_port()  # e.g. 23117
"""

from __future__ import annotations

import random
import socket

LOWEST = 10_000
"""Ports below this are left alone (well-known and registered services)."""
TRIES = 64
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A TCP port nothing listens on now, below the outgoing-connection range where that
    range leaves room (else whatever port the kernel gives)."""
    top = ephemeral_start()
    if top - LOWEST >= TRIES:
        for port in random.sample(range(LOWEST, top), TRIES):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ephemeral_start() -> int:
    """The first port of the range this host gives outgoing connections (32768 if unknown)."""
    try:
        with open(RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
