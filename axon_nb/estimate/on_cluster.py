"""``Cluster.profile`` and ``Cluster.advise``: the advisor over a running cluster's ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from axon_nb.rank import entry

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.estimate.advisor import Advice
    from axon_nb.estimate.profile import ModelProfile


def profile(cluster: ClusterLike, model: Any, data: Any, loss: Any = None, *, samples: int = 4
            ) -> ModelProfile:  # fmt: skip
    """``model`` measured on rank 0 (one forward and backward of ``samples`` items)."""
    from axon_nb.estimate import ModelProfile

    [measured] = cluster.run(entry.profile_model, model, data, loss, samples, ranks=[0],
                             stream=False)  # fmt: skip
    return ModelProfile.from_dict(measured)


def advise(cluster: ClusterLike, model: Any, data: Any = None, loss: Any = None, *,
           bandwidth: Any = None, **options: Any) -> Advice:  # fmt: skip
    """:func:`axon_nb.advise` for ``cluster``'s world and hosts, ``model`` profiled on rank 0
    (``options``: ``advise``'s own, ``device_memory`` and so on)."""
    from axon_nb.estimate import advise as advise_for

    world = len(cluster.targets())
    return advise_for(
        profile=profile(cluster, model, data, loss), world_size=world,
        hosts=max(1, world // cluster.ranks_per_host), bandwidth=bandwidth, **options,
    )  # fmt: skip
