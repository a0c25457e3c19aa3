"""Join a freshly started engine to the torch.distributed world.

Runs on every rank right after the engines connect. Under MPI the ranks talk among themselves
(rank, local rank and the rendezvous port come over MPI); for engines started without MPI the
kernel gathers the probes and hands each rank its plan.
"""

from __future__ import annotations

import gc
import os
import socket
from typing import Any

import psutil

from axon_nb.rank import runtime
from axon_nb.rank.world import world
from axon_nb.rank.world.rendezvous_port import free_port
from axon_nb.spec.bootstrap_spec import BootstrapSpec, address_toward
from axon_nb.spec.placement import PlacementError, Probe, RankPlan, plan_world


def probe(
    rank: int, local_rank: int, local_world_size: int, spec: BootstrapSpec | None = None
) -> Probe:
    """Describe this engine: host, its address on the ranks' network, pid, visible GPUs and
    a free port."""
    import torch  # engine side: counting devices is fine here, the kernel never does it

    host = socket.gethostname()
    ip = _address(host, spec or BootstrapSpec())
    return Probe(
        rank=rank,
        host=host,
        ip=ip,
        iface=_interface_of(ip),
        pid=os.getpid(),
        num_gpus=torch.cuda.device_count(),
        local_rank=local_rank,
        local_world_size=local_world_size,
        free_port=free_port(),
    )


def bootstrap_mpi(spec: BootstrapSpec) -> dict[str, Any]:
    """Probe, agree on a plan over MPI and join the world. Returns this rank's summary."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        mine = probe(rank, node.Get_rank(), node.Get_size(), spec)
    finally:
        node.Free()
    # Every rank plans from the same probes, so all of them raise the same error or none does.
    probes = comm.allgather(mine)
    plans = plan_world(probes, backend=spec.backend, gpus=spec.gpus)
    return join_world(
        plans[rank], spec.timeout_s, watch_dir=spec.watch_dir, kernel_host=spec.kernel_host
    )


def join_world(
    plan: RankPlan,
    timeout_s: float,
    *,
    watch_dir: str | None = None,
    kernel_host: str | None = None,
    store_name: str | None = None,
) -> dict[str, Any]:
    """Bind the device, export the torchrun environment and initialize the process group.

    With ``watch_dir``, the rank then answers stack requests there (``rank/observe/watch.py``);
    ``store_name``: the rendezvous file's name (``world.init_process_group``).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this engine already belongs to a process group; restart the cluster")
    all_local = plan.master_addr == "127.0.0.1"
    os.environ.update(torchrun_env(plan))
    iface = _loopback_interface() if all_local else plan.iface
    if iface:  # gloo and NCCL listen and connect on this network only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)

    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks on one host share its cores; oversubscribed threads slow every rank down.
        torch.set_num_threads(cpu_threads(plan.local_world_size))
    ctx = runtime.RankContext(
        rank=plan.rank,
        world_size=plan.world_size,
        local_rank=plan.local_rank,
        local_world_size=plan.local_world_size,
        host=plan.host,
        pid=plan.pid,
        device=device,
        backend=plan.backend,
        master_addr=plan.master_addr,
        master_port=plan.master_port,
        timeout_s=timeout_s,
        # a store file where the kernel's owner-only directory is local; else a TCPStore
        store_dir=watch_dir if all_local and kernel_host in (None, plan.host) else None,
        private_dir=watch_dir if watch_dir and os.path.isdir(watch_dir) else None,
    )
    world.init_process_group(ctx, store_name)
    runtime.set_context(ctx)
    predefine_names(ctx)
    # What the rank holds now (torch, the engine, the world) lives as long as the rank: out of
    # the cycle collector's sight, every collection (Python's own while training, the group
    # ledger's) walks only what came after, a fraction of the 300,000 objects.
    gc.freeze()
    if watch_dir is not None:
        from axon_nb.rank.observe import watch

        watch.start(watch_dir, ctx.rank)
    _ignore_notices_between_runs()
    return ctx.summary()


def _ignore_notices_between_runs() -> None:
    """A preemption notice with no run in progress has nothing to save: it must not end the
    engine (USR2's default action); ``train`` takes it while it runs (``rank/preemption.py``)."""
    import signal
    import threading

    from axon_nb.spec.notice_signal import ENV, notice_signum

    if threading.current_thread() is threading.main_thread():
        signal.signal(notice_signum(os.environ.get(ENV, "USR2")), signal.SIG_IGN)


def torchrun_env(plan: RankPlan) -> dict[str, str]:
    return {
        "RANK": str(plan.rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(plan.local_rank),
        "LOCAL_WORLD_SIZE": str(plan.local_world_size),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
    }


def predefine_names(ctx: runtime.RankContext) -> None:
    """Put ``rank``, ``world_size``, ``local_rank`` and ``device`` in the engine's namespace."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.user_ns.update(
            rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank, device=ctx.device
        )


def _address(host: str, spec: BootstrapSpec) -> str:
    """This host's address on the ranks' network: ``spec.iface``'s, else the one this host
    reaches the kernel's host from, else what its name resolves to."""
    if spec.iface is not None:
        for addr in psutil.net_if_addrs().get(spec.iface, []):
            if addr.family == socket.AF_INET:
                return str(addr.address)
        known = ", ".join(sorted(psutil.net_if_addrs()))
        raise PlacementError(
            f"--iface {spec.iface}: host {host} has no IPv4 interface of that name (it has {known})"
        )
    if spec.kernel_addr is not None:
        return address_toward(spec.kernel_addr)
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def _interface_of(ip: str) -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def _loopback_interface() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


__all__ = ["BootstrapSpec", "PlacementError", "bootstrap_mpi", "join_world", "probe"]


def cpu_threads(local_world_size: int) -> int:
    """Compute threads for each of ``local_world_size`` CPU ranks sharing this host's cores."""
    return max(1, (os.cpu_count() or 1) // local_world_size)
