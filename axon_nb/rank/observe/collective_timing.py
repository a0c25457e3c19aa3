"""Collective bandwidth on the live ranks, measured as nccl-tests measures it.

For each collective and size: a few warm-up calls, then ``iters`` timed calls back to back
(each one waited for, as nccl-tests' blocking mode does), the time per call being the slowest
rank's. From it:

- algorithm bandwidth ``algbw = size / time``, where ``size`` is nccl-tests' ``count x
  element size``: the buffer each rank reduces (all_reduce, broadcast), the whole gathered
  output (all_gather), the whole input (reduce_scatter), the whole send buffer (all_to_all), the
  message (send/recv);
- bus bandwidth ``busbw = algbw x factor``, the traffic per link an optimal algorithm needs,
  comparable across collectives and rank counts: ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
  all_gather, reduce_scatter and all_to_all, ``1`` for broadcast and send/recv.

Example (what ``cluster.bandwidth`` runs on every rank)::

    measure(["all_reduce"], [2**20, 2**24], iters=20, warmup=5, axis="world")
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from axon_nb.spec.collectives import bus_factor

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
               "send_recv")  # fmt: skip


def measure(
    collectives: list[str], sizes: list[int], *, iters: int, warmup: int, axis: str
) -> list[dict[str, Any]]:
    """(On every rank of the world) one row per collective and size over ``axis``'s group:
    ``collective, axis, ranks, bytes, time_s, algbw, busbw`` (bytes/s)."""
    from axon_nb.rank import runtime

    ctx = runtime.context()
    group, n = _group(axis, ctx)
    rows = []
    for collective in collectives:
        for size in sizes:
            seconds = _time(collective, size, n, group, ctx.device, iters, warmup)
            rows.append({
                "collective": collective, "axis": axis, "ranks": n, "bytes": size,
                "time_s": seconds, "algbw": size / seconds,
                "busbw": size / seconds * bus_factor(collective, n),
            })  # fmt: skip
    return rows


def _group(axis: str, ctx: Any) -> tuple[Any, int]:
    """The process group of ``axis`` that holds this rank, and its size: ``world``, or
    ``intra_host`` (ranks of this host) and ``inter_host`` (one rank per host, same local
    rank). Every rank creates every group, as ``new_subgroups_by_enumeration`` requires."""
    if axis == "world":
        return None, ctx.world_size
    per_host = ctx.local_world_size
    hosts = ctx.world_size // per_host
    if axis == "intra_host":
        ranks = [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    else:
        ranks = [list(range(local, ctx.world_size, per_host)) for local in range(per_host)]
    key = (axis, id(dist.group.WORLD))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_subgroups_by_enumeration(ranks)[0]
    return _GROUPS[key], len(ranks[0])


_GROUPS: dict[tuple[str, int], Any] = {}
"""Axis groups made so far in this world (made once: creating one is a collective)."""


def _time(
    collective: str, size: int, n: int, group: Any, device: torch.device, iters: int,
    warmup: int,
) -> float:  # fmt: skip
    op = _operation(collective, size, n, group, device)
    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    slowest = elapsed.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def _operation(collective: str, size: int, n: int, group: Any, device: torch.device) -> Any:
    """A zero-argument call of one blocking collective on buffers allocated once."""
    count = max(1, size // 4)  # float32 elements of the measured size
    rank = dist.get_rank(group)
    if collective == "all_reduce":
        buf = torch.ones(count, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if collective == "broadcast":
        buf = torch.ones(count, device=device)
        root = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(buf, src=root, group=group)
    if collective == "all_gather":  # size: the gathered output
        out = torch.empty(max(1, count // n) * n, device=device)
        shard = torch.ones(out.numel() // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, shard, group=group)
    if collective == "reduce_scatter":  # size: the whole input
        full = torch.ones(max(1, count // n) * n, device=device)
        out = torch.empty(full.numel() // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, full, group=group)
    if collective == "all_to_all":
        send = torch.ones(max(1, count // n) * n, device=device)
        recv = torch.empty_like(send)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    if collective == "send_recv":  # pairs (0, 1), (2, 3), ...; an odd last rank sits out
        buf = torch.ones(count, device=device)
        peer = rank ^ 1
        if peer >= n:
            return lambda: None
        to = dist.get_global_rank(group, peer) if group is not None else peer
        incoming = torch.empty_like(buf)

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, buf, to), dist.P2POp(dist.irecv, incoming, to)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return exchange
    raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
