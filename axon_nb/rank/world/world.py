"""Tear down and re-form this rank's process group after an interrupt left ranks out of step.

When Ctrl-C stops some ranks between collectives while others are inside one, the others wait
for peers that will never come (gloo's wait cannot be interrupted by a signal). Shutting down
the connections this rank opened for the world makes those peers' collectives fail at once;
then every rank joins a fresh world on a new port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import socket
from datetime import timedelta
from typing import Any, cast

from axon_nb.rank import runtime
from axon_nb.rank.world import kept_world, lightning_ranks

_world_sockets: set[str] = set()
"""Identities ("socket:[inode]") of the sockets opened while joining a world or creating any
process group in it (mesh subgroups, a checkpoint group): the connections :func:`sever`
shuts. Never the engine's own (its controller connections, which zmq may reopen any time)."""


_tracking = False
"""Whether c10d's process-group helper is wrapped (see :func:`_track_group_sockets`)."""

_worlds_joined = 0
"""How many worlds this rank has joined (names each one's store file)."""


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


def sever() -> int:
    """Shut down the connections of this rank's process groups (subgroups included; see
    :data:`_world_sockets`); listeners are left alone. Returns the count."""
    count = 0
    for fd, identity in sorted(open_sockets().items()):
        if identity not in _world_sockets:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
            if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd still belongs to gloo / the store; never close it here
    return count


def collectives_issued() -> dict[str, int]:
    """How many collectives this rank has issued on each of its process groups, by group name
    (c10d's sequence numbers). Ranks whose counts differ for a group are out of step: an
    interrupt stopped one before it issued a collective its peers issued, and the peers' next
    collective would pair with the stale one (gloo then aborts the process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    counts: dict[str, int] = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        with contextlib.suppress(Exception):  # a backend without sequence numbers
            # (torch's stubs declare only the setter of a group's sequence number)
            counts[name] = cast(Any, group)._get_sequence_number_for_group()
    return counts


def init_process_group(ctx: runtime.RankContext, store_name: str | None = None) -> None:
    """``init_process_group`` for ``ctx``'s rank, recording the sockets its store and groups
    open (see :data:`_world_sockets`). ``store_name``: the file store's name where the ranks
    did not join the same worlds before (a resize's new ranks); by default they count them."""
    import torch.distributed as dist

    global _worlds_joined
    _track_group_sockets()
    before = set(open_sockets().values())
    if ctx.store_dir is not None:
        # A fresh file for every world this rank joins (ranks join and re-form together, so
        # they count alike): a severed world's store may be left behind.
        name = store_name or f"store-{ctx.master_port}-{_worlds_joined}"
        path = os.path.join(ctx.store_dir, name)
        store = dist.FileStore(path, ctx.world_size)
    else:
        store = _tcp_store(ctx)
    _worlds_joined += 1
    dist.init_process_group(
        ctx.backend,
        store=store,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=ctx.timeout_s),
        **({"device_id": ctx.device} if ctx.device.type == "cuda" else {}),
    )
    _world_sockets.update(set(open_sockets().values()) - before)  # the store's too
    kept_world.install()  # (Trainer and end_training() destroy the default group)
    lightning_ranks.install()  # (Fabric(strategy="ddp") joins this world)


def _track_group_sockets() -> None:
    """Record the sockets every new process group opens (``new_group``, a device mesh's
    subgroups): all of them are made by c10d's one helper, wrapped here once."""
    import torch.distributed.distributed_c10d as c10d

    global _tracking
    if _tracking:
        return
    _tracking = True
    original = c10d._new_process_group_helper

    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        before = set(open_sockets().values())
        try:
            return original(*args, **kwargs)
        finally:
            _world_sockets.update(set(open_sockets().values()) - before)

    c10d._new_process_group_helper = tracked


def _tcp_store(ctx: runtime.RankContext) -> Any:
    """The rendezvous store across hosts. Rank 0 serves it on ``master_addr`` only: PyTorch's
    own server would listen on every interface, so it is handed a socket bound here."""
    import torch.distributed as dist

    timeout = timedelta(seconds=ctx.timeout_s)
    if ctx.rank != 0:
        return dist.TCPStore(ctx.master_addr, ctx.master_port, ctx.world_size, False, timeout)
    listener = socket.create_server((ctx.master_addr, ctx.master_port), backlog=1024)
    return dist.TCPStore(
        ctx.master_addr,
        ctx.master_port,
        ctx.world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store's from now on
    )


def reform(master_port: int, store_name: str | None = None) -> dict[str, object]:
    """Destroy the current process group and join a fresh one on ``master_port`` (and the
    store file ``store_name``: after a resize the ranks have joined different numbers of
    worlds, so they no longer count alike)."""
    leave()
    os.environ["MASTER_PORT"] = str(master_port)
    fresh = dataclasses.replace(runtime.context(), master_port=master_port)
    init_process_group(fresh, store_name)
    runtime.set_context(fresh)
    return fresh.summary()


def leave() -> None:
    """Destroy this rank's process groups (the world and every group made in it) and forget
    what named them; the rank then belongs to no world until it joins one."""
    import torch.distributed as dist

    from axon_nb.parallel import group_ledger
    from axon_nb.rank.checkpoint.checkpoint_schedule import forget_save_group
    from axon_nb.rank.training import trainstate

    forget_save_group()  # its group dies with the world
    group_ledger.forget()  # and so do the layouts' groups
    trainstate.forget_world()  # (DTensor's caches name groups of the old world)
    if dist.is_initialized():
        # A severed group may fail to say goodbye; it is gone either way.
        with contextlib.suppress(Exception):
            kept_world.destroy_world()
    gc.collect()  # let the old group close its sockets before the new one opens any
