"""Plan the world from what every rank reports: devices, backend, rendezvous address.

Pure functions over plain data, so every rank computes the same plan (and the same error)
from the same probes, and no rank walks into ``init_process_group`` while another gave up.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "nccl", "gloo")


class PlacementError(ValueError):
    """The requested devices or backend cannot be honoured on these hosts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """What one engine reports about itself before the world exists."""

    rank: int
    """Global rank."""
    host: str
    """Host name."""
    ip: str
    """Address other hosts can reach this one on."""
    iface: str | None
    """The network interface that holds ``ip`` (None if none does, e.g. a name lookup)."""
    pid: int
    """Engine process id."""
    num_gpus: int
    """CUDA devices visible to the engine."""
    local_rank: int
    """Rank among engines on the same host."""
    local_world_size: int
    """Engines on the same host."""
    free_port: int
    """A port that was free on this host when probed (rank 0's is used for the rendezvous)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """Everything one rank needs to join the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str
    pid: int
    device: str
    """``"cpu"`` or ``"cuda:<index>"``."""
    backend: str
    master_addr: str
    master_port: int
    iface: str | None = None
    """This rank's network interface when the world spans hosts (gloo and NCCL use it)."""


def plan_world(
    probes: list[Probe], *, backend: str = "auto", gpus: tuple[int, ...] | None = None
) -> list[RankPlan]:
    """Assign a device to every rank and resolve the backend.

    ``gpus`` restricts the CUDA devices used on each host (local rank ``i`` gets ``gpus[i]``);
    ranks beyond the listed devices run on the CPU, which only the gloo backend allows.

    Example::

        plans = plan_world(probes, backend="auto", gpus=(0, 1))
    """
    if backend not in BACKENDS:
        raise PlacementError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    probes = sorted(probes, key=lambda p: p.rank)
    problems = [msg for p in probes for msg in _check_gpus(p, gpus)]
    if problems:
        raise PlacementError("; ".join(dict.fromkeys(problems)) + _GPUS_HINT)

    devices = [_device_for(p, gpus) for p in probes]
    on_cpu = [p for p, d in zip(probes, devices, strict=True) if d == "cpu"]
    if backend == "nccl" and on_cpu:
        hosts = sorted({p.host for p in on_cpu})
        raise PlacementError(
            f"--backend nccl needs one GPU per rank, but rank(s) "
            f"{', '.join(str(p.rank) for p in on_cpu)} on {', '.join(hosts)} have none "
            f"(usable GPUs per host: {_usable_gpus(probes, gpus)}). Start fewer ranks, list "
            "more devices with --gpus, or use --backend gloo."
        )
    resolved = backend if backend != "auto" else ("gloo" if on_cpu else "nccl")

    all_local = len({p.host for p in probes}) == 1
    master_addr = "127.0.0.1" if all_local else probes[0].ip
    world_size = len(probes)
    return [
        RankPlan(
            rank=p.rank,
            world_size=world_size,
            local_rank=p.local_rank,
            local_world_size=p.local_world_size,
            host=p.host,
            pid=p.pid,
            device=d,
            backend=resolved,
            master_addr=master_addr,
            master_port=probes[0].free_port,
            iface=None if all_local else p.iface,
        )
        for p, d in zip(probes, devices, strict=True)
    ]


_GPUS_HINT = ". List existing devices with --gpus (e.g. --gpus 0,1) or leave it out."


def _check_gpus(probe: Probe, gpus: tuple[int, ...] | None) -> list[str]:
    if gpus is None:
        return []
    missing = [g for g in gpus if g < 0 or g >= probe.num_gpus]
    if not missing:
        return []
    have = f"cuda:0..cuda:{probe.num_gpus - 1}" if probe.num_gpus else "no GPUs"
    names = ", ".join(f"cuda:{g}" for g in missing)
    return [f"--gpus names {names}, which does not exist on host {probe.host} (it has {have})"]


def _device_for(probe: Probe, gpus: tuple[int, ...] | None) -> str:
    usable = gpus if gpus is not None else tuple(range(probe.num_gpus))
    if probe.local_rank < len(usable):
        return f"cuda:{usable[probe.local_rank]}"
    return "cpu"


def _usable_gpus(probes: list[Probe], gpus: tuple[int, ...] | None) -> str:
    per_host = {p.host: (len(gpus) if gpus is not None else p.num_gpus) for p in probes}
    return ", ".join(f"{h}: {n}" for h, n in per_host.items())
