"""The kernel's check of an expert-parallel run before the run is sent to the ranks.

Rank 0 builds the model once on the meta device (no memory, no weights) and looks its experts
modules up with the plan (``axon_nb.parallel.expert_plan``): a model with no MoE layer, a
plan naming nothing and ``ep`` not dividing the experts are refused here, as a ``ValueError``
in the notebook, with the cluster and every run on it untouched. A factory that cannot build
on the meta device (it loads files, say) is checked by the run itself, with the same messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axon_nb.rank import entry
from axon_nb.spec.train_spec import TrainSpec

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike


def check_experts(cluster: ClusterLike, spec: TrainSpec) -> None:
    """Raise ``ValueError`` if ``spec``'s strategy splits experts its model does not have.

    Example::

        check_experts(cluster, spec)   # ExpertParallel(ep=2) on a dense GPT: ValueError
    """
    dims = spec.strategy.dims(len(cluster.targets()), cluster.ranks_per_host)
    if dims.ep == 1 or not callable(spec.model):
        return
    expert = spec.strategy.config().expert
    plan = expert.plan if expert is not None else None
    [problem] = cluster.run(
        entry.expert_layout_problem, spec.model, plan, dims.ep, ranks=[0], stream=False
    )
    if problem:
        raise ValueError(problem)
