"""Process groups a layout made, destroyed once no run holds the layout any more.

Every ``parallelize`` builds a device mesh: a process group per mesh axis and one per
flattened axis. A gloo group keeps three threads and its sockets, and its threads wake up
even when idle, so on a rank that lives through many runs (a notebook's cluster) groups
that nobody uses would pile up and keep the CPU busy. Groups are therefore recorded against
the :class:`~axon_nb.spec.parallel_dims.ParallelDims` they were made for, and destroyed when
no kept run lays its model out on those dims (``trainstate.put`` and ``drop`` ask).

Groups made outside ``parallelize`` (the world, a user's ``new_group``) are never touched.

A destroyed group's threads end when the group object is freed, and the meshes and wrapped
modules that refer to it sit in reference cycles: only the cycle collector frees them. A full
collection costs a rank a few tenths of a second (it walks every object torch and the engine
made), which was most of a short ``train`` call when it ran on every release; so it runs once
``LINGER_LIMIT`` destroyed groups are still alive (:func:`collect_lingering`; beyond those the
last one could not free), which bounds their idle threads, and Python's own collector frees
most before that.

Example::

    with recording(dims):
        parallel = build(...)          # groups made here belong to ``dims``
    release_unheld([parallel.dims])    # destroys the groups of every other recorded dims
    collect_lingering()                # frees them once enough wait for the cycle collector
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

_MADE: dict[int, tuple[object, list[Any]]] = {}
"""id(owner) -> (owner, the process groups made for it)."""

LINGER_LIMIT = 8
"""Destroyed groups allowed to wait for Python's collector before one is forced (a gloo
group keeps three threads)."""

_LINGERING: list[weakref.ref] = []
"""The destroyed groups, while their objects are alive."""

_survivors = 0
"""How many of them the last forced collection left alive: something still refers to them
(a model its user kept), so collecting again frees them no more; the next one waits for
``LINGER_LIMIT`` more."""


@contextlib.contextmanager
def recording(owner: object) -> Iterator[None]:
    """Attribute every process group created inside the block to ``owner``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if not dist.is_initialized():
        yield
        return
    before = set(_world.pg_map)
    try:
        yield
    finally:
        made = [g for g in _world.pg_map if g not in before]
        if made:
            _MADE.setdefault(id(owner), (owner, []))[1].extend(made)


def release_unheld(held: Iterable[object]) -> int:
    """Destroy the groups of every recorded owner not in ``held`` (by identity); returns how
    many were destroyed. Groups already gone (a re-formed world) are skipped. Compiled graphs
    are dropped when any was destroyed (they may name the groups)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    keep = {id(owner) for owner in held}
    destroyed = 0
    for key in [k for k in _MADE if k not in keep]:
        _, groups = _MADE.pop(key)
        for group in groups:
            if group not in _world.pg_map:
                continue
            try:
                dist.destroy_process_group(group)
                destroyed += 1
                _LINGERING.append(weakref.ref(group))
            except Exception as e:  # (one failing must not keep the rest)
                warnings.warn(f"could not destroy process group {group.group_name}: {e}",
                              stacklevel=2)  # fmt: skip
    if destroyed and "torch._dynamo" in sys.modules:
        # Compiled graphs of a mesh's collectives name its groups, and a kept run of the
        # same layout may reuse such a graph: compile again rather than meet them.
        import torch

        torch.compiler.reset()
    return destroyed


def collect_lingering(limit: int = LINGER_LIMIT) -> int:
    """Run the cycle collector when ``limit`` or more destroyed groups are alive beyond those
    the last forced collection left (call it once nothing else refers to them: after
    DTensor's caches are emptied); returns how many are alive afterwards."""
    global _survivors
    _LINGERING[:] = [ref for ref in _LINGERING if ref() is not None]
    if len(_LINGERING) - _survivors >= limit:
        gc.collect()
        _LINGERING[:] = [ref for ref in _LINGERING if ref() is not None]
        _survivors = len(_LINGERING)
    _survivors = min(_survivors, len(_LINGERING))
    return len(_LINGERING)


def forget() -> None:
    """Drop every record (the world these groups lived in is gone)."""
    global _survivors
    _MADE.clear()
    _LINGERING.clear()
    _survivors = 0
