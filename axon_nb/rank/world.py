"""Tear down and re-form this rank's process group after an interrupt left ranks out of step.

When Ctrl-C stops some ranks between collectives while others are inside one, the others wait
for peers that will never come (gloo's wait cannot be interrupted by a signal). Shutting down
the connections this rank opened for the world makes those peers' collectives fail at once;
then every rank joins a fresh world on a new port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
from datetime import timedelta

from axon_nb.rank import runtime

_world_sockets: dict[int, str] = {}
"""fd -> socket identity ("socket:[inode]") of the connections the current world opened."""


def open_sockets() -> dict[int, str]:
    """This process's sockets as fd -> ``socket:[inode]`` (Linux ``/proc``; empty elsewhere).

    Identity matters, not the fd number: numbers of closed sockets are reused.
    """
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def remember_world_sockets(before: dict[int, str]) -> None:
    """Record the sockets ``init_process_group`` opened (those not open ``before`` it)."""
    old = set(before.values())
    _world_sockets.clear()
    _world_sockets.update({fd: s for fd, s in open_sockets().items() if s not in old})


def sever() -> int:
    """Shut down this rank's connected world sockets; listeners are left alone. Returns count."""
    count = 0
    now = open_sockets()
    for fd, identity in sorted(_world_sockets.items()):
        if now.get(fd) != identity:  # closed by its owner, maybe reused for something else
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd still belongs to gloo / the store; never close it here
    return count


def init_process_group(ctx: runtime.RankContext) -> None:
    """``init_process_group`` for ``ctx``'s rank, remembering the sockets it opens."""
    import torch.distributed as dist

    before = open_sockets()
    dist.init_process_group(
        ctx.backend,
        init_method="env://",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=ctx.timeout_s),
        **({"device_id": ctx.device} if ctx.device.type == "cuda" else {}),
    )
    remember_world_sockets(before)


def reform(master_port: int) -> dict[str, object]:
    """Destroy the current process group and join a fresh one on ``master_port``."""
    import torch.distributed as dist

    if dist.is_initialized():
        # A severed group may fail to say goodbye; it is gone either way.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    gc.collect()  # let the old group close its sockets before the new one opens any
    os.environ["MASTER_PORT"] = str(master_port)
    fresh = dataclasses.replace(runtime.context(), master_port=master_port)
    init_process_group(fresh)
    runtime.set_context(fresh)
    return fresh.summary()
