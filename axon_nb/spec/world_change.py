"""What a resize of a live cluster changes (``cluster.resize``): which ranks leave, where new
ones go and what each rank's place in the new world is. Pure functions over plain data, shared
by the kernel (which plans) and the ranks (which retire with :data:`RETIRED_EXIT`).
"""

from __future__ import annotations

import dataclasses

from axon_nb.spec.placement import PlacementError, Probe, RankPlan, plan_world

ID_BASE_ENV = "AXON_NB_ENGINE_ID_BASE"
"""Set for the engines of a later launch (``cluster.resize``): each asks the controller for
the engine id ``base + its rank in that launch`` (``rank/world/engine.py``), so that engine
ids stay the world's ranks."""

RETIRED_EXIT = 86
"""The exit code of an engine retired by a resize: its parent (``rank/world/launch.py``) then
keeps the rank's MPI slot until the cluster stops, as it does for a killed engine (MPICH's
process managers end every rank of a launch when one leaves it early)."""


def place_on_hosts(probes: list[Probe]) -> list[Probe]:
    """``probes`` in rank order, each with its place among its host's ranks: counted in rank
    order, so a rank that stays keeps its local rank (and so its device) and a new rank comes
    after its host's others. Example::

        place_on_hosts([a0, a1, b2])   # local ranks 0, 1, 0; local world sizes 2, 2, 1
    """
    ordered = sorted(probes, key=lambda p: p.rank)
    counts: dict[str, int] = {}
    placed = []
    for probe in ordered:
        placed.append(dataclasses.replace(probe, local_rank=counts.get(probe.host, 0)))
        counts[probe.host] = counts.get(probe.host, 0) + 1
    return [dataclasses.replace(p, local_world_size=counts[p.host]) for p in placed]


def plan_resize(
    probes: list[Probe], current: dict[int, str], *, backend: str, gpus: tuple[int, ...] | None
) -> list[RankPlan]:
    """The resized world's plan from every rank's probe (``current``: the device of each rank
    that stays, which it keeps); raises :class:`PlacementError` saying what does not fit.
    Example::

        plans = plan_resize(probes, {0: "cpu", 1: "cpu"}, backend="gloo", gpus=None)
    """
    plans = plan_world(place_on_hosts(probes), backend=backend, gpus=gpus)
    moved = [(p.rank, current[p.rank], p.device) for p in plans if p.rank in current]
    moved = [(rank, was, now) for rank, was, now in moved if was != now]
    if moved:
        rank, was, now = moved[0]
        raise PlacementError(
            f"the resized world would move rank {rank} from {was} to {now}: a rank that stays "
            "keeps its device. Resize to a size whose new ranks come after the others on "
            "their hosts, or restart the cluster with that size"
        )
    return plans


def hosts_after(
    hosts: tuple[tuple[str, int], ...] | None, added: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int], ...] | None:
    """The cluster's ``--hosts`` once ``added`` slots joined (a host listed again gets more
    slots). Example::

        hosts_after((("a", 1), ("b", 1)), (("b", 2),))   # (("a", 1), ("b", 3))
    """
    if not added:
        return hosts
    slots = dict(hosts or ())
    for host, count in added:
        slots[host] = slots.get(host, 0) + count
    return tuple(slots.items())


def describe_change(old: int, new: int) -> str:
    """Which ranks join or leave. Example::

    describe_change(2, 4)   # 'ranks 2-3 joined'
    """
    if new > old:
        return f"rank {old} joined" if new == old + 1 else f"ranks {old}-{new - 1} joined"
    return f"rank {new} left" if old == new + 1 else f"ranks {new}-{old - 1} left"
