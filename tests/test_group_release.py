"""A run's process groups live as long as the run: replacing or dropping it destroys them, so
a cluster that trains cell after cell keeps as many groups (and gloo threads) as it has runs,
and a kept run resumed after others came and went still trains exactly."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import axon_nb
from axon_nb import DDP, FSDP, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset
from axon_nb.parallel.group_ledger import LINGER_LIMIT
from axon_nb.rank import entry

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 256, block_size=16, vocab_size=64),
    loss=lm_loss,
    batch_size=8,
    optimizer=("adamw", {"lr": 3e-3}),
)


def _groups_and_threads() -> tuple[int, int, dict[str, int]]:
    """Registered groups, and the fewest threads over half a second (a thread that is
    ending still has its entry in ``/proc`` for a moment) with their names at that count."""
    import collections
    import gc
    import os
    import time

    from torch.distributed.distributed_c10d import _world

    gc.collect()
    fewest: dict[str, int] | None = None
    for _ in range(10):
        names: collections.Counter[str] = collections.Counter()
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names[f.read().strip()] += 1
            except OSError:  # (it ended meanwhile)
                pass
        if fewest is None or names.total() < sum(fewest.values()):
            fewest = dict(names)
        time.sleep(0.05)
    assert fewest is not None
    return len(_world.pg_map), sum(fewest.values()), fewest


def _lingering() -> int:
    """Destroyed groups still alive (their threads too), without running the collector."""
    import sys

    from axon_nb.parallel import group_ledger

    return group_ledger.collect_lingering(limit=sys.maxsize)


def _alive_after_collecting() -> int:
    """Destroyed groups that a full collection leaves alive: something still refers to them."""
    import gc
    import sys

    from axon_nb.parallel import group_ledger

    gc.collect()
    return group_ledger.collect_lingering(limit=sys.maxsize)


def _unregistered_groups_of(name: str) -> list[str]:
    """The groups of run ``name``'s mesh that are no longer registered (destroyed)."""
    from torch.distributed.distributed_c10d import _world

    from axon_nb.rank.training import trainstate

    mesh = trainstate.get(name).parallel.mesh
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return [g.group_name for g in groups if g not in _world.pg_map]


def test_training_cell_after_cell_keeps_the_groups_of_the_kept_runs_only(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    strategies = [DDP(), FSDP(), TensorParallel(), ZeRO(stage=2), ZeRO(stage=1)]
    seen: list[list[tuple[int, int, dict[str, int]]]] = []
    # Round 0 starts what a rank starts once, on first use (thread pools); each layout then
    # holds as much in round 2 as in round 1.
    for round_ in range(3):
        for i, strategy in enumerate(strategies):
            pooled_cluster_2.train(**RUN, strategy=strategy, steps=1, name="cells")
            now = pooled_cluster_2.run(_groups_and_threads, stream=False)
            if round_ == 0:
                seen.append(now)
                continue
            if round_ == 1:
                seen[i] = now
                continue
            for rank, ((groups0, threads0, names0), (groups, threads, names)) in enumerate(
                zip(seen[i], now, strict=True)
            ):
                where = f"rank {rank} under {strategy.describe()}"
                assert groups == groups0, f"{where} holds {groups} groups, {groups0} before"
                new = {k: n - names0.get(k, 0) for k, n in names.items() if n > names0.get(k, 0)}
                assert threads <= threads0, f"{where}: {threads} threads, {threads0} before: {new}"
    first = seen[0]
    pooled_cluster_2.run(entry.drop_run, "cells", stream=False)
    dropped = pooled_cluster_2.run(_groups_and_threads, stream=False)
    fewer = [g < g0 for (g, _, _), (g0, _, _) in zip(dropped, first, strict=True)]
    assert all(fewer), (dropped, first)


def test_destroyed_groups_wait_for_the_cycle_collector_a_bounded_while(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """The ledger forces a collection only once LINGER_LIMIT destroyed groups are alive (a
    full one costs a short call most of its time); never more wait than that."""
    held = max(pooled_cluster_2.run(_alive_after_collecting, stream=False))  # (earlier modules')
    alive = []
    for strategy in [FSDP(), TensorParallel(), DDP()] * 4:
        pooled_cluster_2.train(**RUN, strategy=strategy, steps=1, name="cells")
        alive.append(max(pooled_cluster_2.run(_lingering, stream=False)) - held)
    assert max(alive) < LINGER_LIMIT, alive
    pooled_cluster_2.run(entry.drop_run, "cells", stream=False)


def test_a_replaced_layout_is_freed_by_the_collection_its_replacement_forces(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Only a DDP run's ``put`` destroys groups here (TensorParallel's four), so the forced
    collection comes there, while the replaced run's model was still referred to (the
    ranks' ``%%axon`` variable, or a local of ``put``): its groups survived it and counted
    as kept, and up to 11 waited for the collector."""
    held = max(pooled_cluster_2.run(_alive_after_collecting, stream=False))  # (earlier modules')
    alive = []
    for strategy in [TensorParallel(), DDP()] * 4:
        pooled_cluster_2.train(**RUN, strategy=strategy, steps=1, name="cells")
        alive.append(max(pooled_cluster_2.run(_lingering, stream=False)) - held)
    assert max(alive) < LINGER_LIMIT, alive
    pooled_cluster_2.run(entry.drop_run, "cells", stream=False)


def test_a_failed_call_keeps_nothing_it_built_alive(pooled_cluster_2: axon_nb.Cluster) -> None:
    """A rank keeps its last error until the next one (IPython's sys.last_traceback); its
    frames held the failed call's model and mesh, and so the groups destroyed with it."""
    held = pooled_cluster_2.run(_alive_after_collecting, stream=False)  # (earlier modules')
    pooled_cluster_2.train(**RUN, strategy=TensorParallel(), steps=1, name="cells")
    with pytest.raises(axon_nb.RankError, match="does not fit the model"):
        plan = {"blocks.*.ffn": "colwise"}
        pooled_cluster_2.train(**RUN, strategy=TensorParallel(plan=plan), steps=1, name="cells")
    pooled_cluster_2.train(**RUN, strategy=DDP(), steps=1, name="cells")  # the failed layout's go
    alive = pooled_cluster_2.run(_alive_after_collecting, stream=False)
    assert all(a <= h for a, h in zip(alive, held, strict=True)), (alive, held)
    pooled_cluster_2.run(entry.drop_run, "cells", stream=False)


def test_a_run_resumed_beside_another_and_after_it_was_dropped_continues_exactly(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    # Another run of the same layout comes and goes: its groups go with it, the kept run's
    # stay (and DTensor's caches, which could hand the kept run the other's mesh, are
    # emptied whenever the run in use changes).
    whole = pooled_cluster_2.train(**RUN, strategy=TensorParallel(), steps=9, name="whole").losses
    losses = pooled_cluster_2.train(**RUN, strategy=TensorParallel(), steps=3, name="kept").losses
    pooled_cluster_2.train(**RUN, strategy=TensorParallel(), steps=2, name="passing")
    losses += pooled_cluster_2.train(
        **RUN, strategy=TensorParallel(), steps=3, name="kept", resume=True
    ).losses
    pooled_cluster_2.run(entry.drop_run, "passing", stream=False)
    assert pooled_cluster_2.run(_unregistered_groups_of, "kept", stream=False) == [[], []]
    losses += pooled_cluster_2.train(
        **RUN, strategy=TensorParallel(), steps=3, name="kept", resume=True
    ).losses
    assert losses == pytest.approx(whole, rel=1e-6)
    for name in ("whole", "kept"):
        pooled_cluster_2.run(entry.drop_run, name, stream=False)
