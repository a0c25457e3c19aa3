"""The cluster's world outlives the code run in it.

Trainers users already run in cells end by destroying the default process group: Hugging
Face ``Trainer`` at the end of ``train()`` and Accelerate's ``Accelerator.end_training()``
call ``torch.distributed.destroy_process_group()``. On a rank that group is the cluster's
world, which the next cell, ``cluster.train`` and every feature use; scripts under
``%axon_run`` run in processes of their own and are not concerned. So, once a rank has
joined its world, ``destroy_process_group()`` of the default group does nothing there (other
groups are destroyed as asked); the cluster itself leaves its world with
:func:`destroy_world` (when it re-forms it). Example (on a rank)::

    install()
    torch.distributed.destroy_process_group()   # kept: the world still works
    destroy_world()                             # what re-forming the world does
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_original: Callable[..., None] | None = None


def install() -> None:
    """Make ``torch.distributed.destroy_process_group()`` keep the default group (once)."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _original is not None:
        return
    original = _original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            return  # the cluster's world: it stays for the next cell
        original(group)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def destroy_world() -> None:
    """Destroy the default group for real (the cluster re-forming its world)."""
    import torch.distributed as dist

    (_original or dist.destroy_process_group)()
