"""``train``: a training run on a cluster's ranks, the whole loop there."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle

from axon_nb.rank import entry
from axon_nb.strategies import DDP
from axon_nb.train.handle import TrainHandle
from axon_nb.train.result import TrainResult
from axon_nb.train.spec import check_world, make_spec
from axon_nb.widgets.frontend import in_notebook

if TYPE_CHECKING:
    from axon_nb.cluster import Cluster


def train(
    cluster: Cluster,
    model: Any = None,
    data: Any = None,
    *,
    strategy: Any = None,
    optimizer: Any = None,
    loss: Callable[..., Any] | None = None,
    steps: int,
    batch_size: int,
    grad_accum: int = 1,
    mixed_precision: str | None = None,
    clip_grad_norm: float | None = None,
    schedule: str = "constant",
    warmup_steps: int = 0,
    seed: int = 0,
    resume: bool = False,
    name: str = "model",
    metrics_interval_s: float = 0.5,
    block: bool = True,
) -> TrainResult | TrainHandle:
    """Train ``model`` on every rank of ``cluster`` with ``strategy`` (default ``DDP()``).

    ``batch_size`` is the global batch per optimizer step: each data-parallel rank takes
    ``batch_size / dp`` samples of its own data shard, in ``grad_accum`` micro-batches. The
    trained model stays on the ranks as ``name`` (a ``%%axon`` cell can evaluate it; names
    that would shadow ``rank``, ``device``, builtins or ``torch`` are refused), and
    ``resume=True`` continues it (model, optimizer, step, data order), taking new optimizer
    settings such as ``optimizer=("adamw", {"lr": 1e-4})``.

    Returns a :class:`TrainResult`, or with ``block=False`` a :class:`TrainHandle` at once.
    Ctrl-C stops every rank at the same step boundary and returns the result so far.
    ``cluster.train(...)`` is the same call. Example::

        from axon_nb import DDP
        result = cluster.train(
            model=make_model, data=make_dataset, strategy=DDP(comm_hook="bf16"),
            optimizer=("adamw", {"lr": 3e-4}), loss=torch.nn.functional.cross_entropy,
            steps=200, batch_size=32, grad_accum=2, mixed_precision="bf16",
            clip_grad_norm=1.0, seed=0,
        )
        result.losses[-1]
    """
    spec = make_spec(
        DDP,
        model=model,
        data=data,
        strategy=strategy,
        optimizer=optimizer,
        loss=loss,
        steps=steps,
        batch_size=batch_size,
        grad_accum=grad_accum,
        mixed_precision=mixed_precision,
        clip_grad_norm=clip_grad_norm,
        schedule=schedule,
        warmup_steps=warmup_steps,
        seed=seed,
        resume=resume,
        name=name,
        metrics_interval_s=metrics_interval_s,
    )
    targets = cluster.targets()
    check_world(spec, len(targets), cluster.ranks_per_host)
    run = uuid.uuid4().hex[:12]
    ar = cluster.view(targets).apply_async(entry.train, cloudpickle.dumps(spec), run)
    handle = TrainHandle(cluster, ar, targets, spec, run)
    cluster.last_run = handle
    if block and in_notebook():
        handle.show()
    return handle.wait() if block else handle
