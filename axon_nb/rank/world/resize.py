"""A rank's part in resizing the live cluster (``cluster.resize``; the kernel's side and the
order of the steps: ``cluster/resize.py``).

Every rank of the old world first leaves it together (:func:`leave_for_resize`: the run that
goes on is packed on rank 0, ``rank/training/moved_run.py``; other runs and the objects
``%%axon`` cells built on the old process groups are dropped, by name). A rank the resize
removes then retires (:func:`retire`): its engine exits and its parent keeps the MPI slot
(``spec/world_change.RETIRED_EXIT``). A rank that stays joins the new world with its rank and
device (:func:`rejoin`); the new ranks join it as any rank without MPI does
(``bootstrap.join_world``), on the same rendezvous. Example (what the kernel sends)::

    report = leave_for_resize("model")   # every old rank
    rejoin(plan, "store-resize-3f2a")    # every rank that stays
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any

from axon_nb.rank import runtime
from axon_nb.rank.world import bootstrap, world
from axon_nb.spec.placement import RankPlan
from axon_nb.spec.world_change import RETIRED_EXIT

RETIRE_AFTER_S = 0.5
"""A retiring engine exits this long after it answered (its answer must reach the kernel)."""


def leave_for_resize(keep: str | None) -> dict[str, Any]:
    """(Every rank of the old world) Pack the run ``keep`` for the new world (a collective),
    drop every other run and every object in the namespace built on the old world's process
    groups, then leave the world. What was moved and dropped, by name."""
    from axon_nb.rank.training import moved_run, trainstate

    runs = trainstate.runs()
    # (a run a resize moved before and no call rebuilt yet stays packed on rank 0)
    moved = moved_run.pack(keep) if keep in runs else moved_run.holds(keep)
    dropped_runs = sorted({*runs, *moved_run.forget_all_but(keep)} - {keep})
    for name in runs:
        trainstate.drop(name)
    dropped_objects = drop_group_objects()
    world.leave()
    return {"moved": moved, "runs": dropped_runs, "objects": dropped_objects}


def drop_group_objects() -> list[str]:
    """Remove from the engine's namespace what was built on this world's process groups
    (groups, meshes, DTensors, models wrapped by DDP or FSDP or holding DTensors, optimizers
    over DTensors): after a resize their collectives would name groups that are gone. Their
    names, sorted."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return []
    if shell is None:
        return []
    names = sorted(
        name
        for name, value in list(shell.user_ns.items())
        if not name.startswith("_") and _on_groups(value)
    )
    for name in names:
        del shell.user_ns[name]
    return names


def _on_groups(value: Any) -> bool:
    """Whether ``value`` holds or is made of this world's process groups."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if isinstance(value, dist.ProcessGroup | DeviceMesh | DTensor):
        return True
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return True
    if isinstance(value, torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        return isinstance(value, FSDPModule) or any(
            isinstance(p, DTensor) for p in value.parameters()
        )
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for g in value.param_groups for p in g["params"])
    return False


def retire() -> int:
    """(A rank the resize removes) End this engine :data:`RETIRE_AFTER_S` from now, once its
    answer is out; its pid. It has left the world already (:func:`leave_for_resize`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    timer = threading.Timer(RETIRE_AFTER_S, os._exit, args=(RETIRED_EXIT,))
    timer.daemon = True
    timer.start()
    return os.getpid()


def rejoin(plan: RankPlan, store_name: str) -> dict[str, Any]:
    """(A rank that stays) Join the resized world ``plan`` describes: the same rank and
    device, the new world size, rendezvous and ranks on this host. This rank's summary."""
    import torch

    ctx = runtime.context()
    if plan.rank != ctx.rank or plan.device != str(ctx.device):
        raise RuntimeError(
            f"the resize planned rank {plan.rank} on {plan.device} for rank {ctx.rank} on "
            f"{ctx.device}: a rank that stays keeps both"
        )
    fresh = dataclasses.replace(
        ctx,
        world_size=plan.world_size,
        local_world_size=plan.local_world_size,
        master_addr=plan.master_addr,
        master_port=plan.master_port,
    )
    os.environ.update(bootstrap.torchrun_env(plan))
    if ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(bootstrap.cpu_threads(plan.local_world_size))
    world.init_process_group(fresh, store_name)
    runtime.set_context(fresh)
    bootstrap.predefine_names(fresh)
    return fresh.summary()
