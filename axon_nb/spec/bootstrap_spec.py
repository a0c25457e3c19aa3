"""What the kernel asks of every rank when it joins the world, and the route lookup both
sides use to pick the ranks' network (pure Python: the kernel builds it, ``rank/world/bootstrap.py``
carries it out)."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapSpec:
    """What the kernel asks of every rank."""

    backend: str = "auto"
    """``auto`` (nccl when every rank has a GPU, else gloo), ``nccl`` or ``gloo``."""
    gpus: tuple[int, ...] | None = None
    """CUDA device indices to use on each host; ``None`` means all visible devices."""
    timeout_s: float = 300.0
    """Timeout of collectives, in seconds."""
    watch_dir: str | None = None
    """The cluster's owner-only directory where the kernel asks for stacks
    (``rank/observe/watch.py``)."""
    iface: str | None = None
    """Across hosts: the network interface the ranks use; None: the one that routes to
    ``kernel_addr``."""
    kernel_addr: str | None = None
    """Across hosts: the kernel host's address on the ranks' network (the controller's)."""
    kernel_host: str | None = None
    """The kernel's host name: ranks all on it meet through a file in ``watch_dir``."""


def address_toward(host: str) -> str:
    """This machine's address on the network that reaches ``host`` (a route lookup; nothing
    is sent). Raises ``OSError`` when no route does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])
