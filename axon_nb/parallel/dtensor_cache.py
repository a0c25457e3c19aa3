"""Forgetting the device meshes DTensor's dispatch caches hold from earlier layouts.

DTensor caches its sharding decisions keyed by the input specs, and a ``DeviceMesh`` compares
equal to any other mesh of the same shape, names and ranks, whatever process groups it holds.
So an op on a new run's DTensors can return a DTensor on an *earlier* run's mesh, and its next
collective goes over that run's groups. That works while those groups live; after the world is
re-formed (``rank/world/world.py``: group names restart at 0) the names point nowhere ("Could
not resolve the process group registered under the name 63") or at another group (a gather of
the wrong size). Each layout starts with the caches empty.

Example::

    forget_cached_meshes()   # before parallelize builds a mesh
"""

from __future__ import annotations


def forget_cached_meshes() -> None:
    """Clear DTensor's sharding-propagation caches, Python's and the C++ fast path's (the two
    that PyTorch's ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` clears; that
    package is not imported: it pulls in dynamo and inductor, 0.4 s of CPU per rank), its
    cached redistribution plans and planners, and the meshes' topology records (each holds
    its mesh, and so the mesh's process groups, for the life of the process). A rank that
    never loaded DTensor has nothing cached, and does not load it here (1 s of CPU)."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    # Each of these exists only in some PyTorch releases (the pin is 2.13; `torch>=2.6` runs).
    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(MeshTopoInfo.build_from_mesh, "cache_clear", None),
    ):
        if clear is not None:
            clear()
