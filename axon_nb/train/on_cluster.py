"""``train``: a training run on a cluster's ranks, the whole loop there, from a built spec.

``Cluster.train`` takes the options by name, builds the :class:`TrainSpec` and calls
:func:`train`. What a run does with them:

``batch_size`` is the global batch per optimizer step: each data-parallel rank takes
``batch_size / dp`` samples of its own data shard, in ``grad_accum`` micro-batches. The
trained model stays on the ranks as ``name`` (a ``%%axon`` cell can evaluate it; names that
would shadow ``rank``, ``device``, builtins or ``torch`` are refused), and ``resume=True``
continues it (model, optimizer, step, data order), taking new optimizer settings such as
``optimizer=("adamw", {"lr": 1e-4})``.

With ``checkpoint_dir``, a sharded checkpoint is written there every ``checkpoint_every``
steps and/or ``checkpoint_every_s`` seconds, in the background (only the newest ``keep``
stay); with ``max_restarts``, a rank that dies makes the kernel restart the ranks, load the
newest checkpoint and train on to the same step count (``result.restarts``). With
``min_ranks``, a rank that cannot come back (the restart fails, or the same rank dies again)
is left out: training goes on with fewer ranks, at least ``min_ranks``, where the strategy's
layout and ``batch_size`` allow it.

``data`` may be a dask DataFrame (with ``columns=(features, target)``), a pair of dask Arrays
``(inputs, targets)`` or a Bag of ``(input, target)`` items: its partitions are computed on
the ranks' own dask workers (``cluster.dask()``, started on demand), each rank keeping only
its share; the rows never pass through the kernel.

``compile=True`` compiles each of the model's blocks with ``torch.compile`` before it is
sharded. On GPU ranks Adam and AdamW use PyTorch's fused kernels unless ``fused`` or
``foreach`` is given, and the loop never waits for the GPU within a step: the ranks'
agreement (loss, stop) is read one step later and the next batch is copied ahead.

``log_to=["tensorboard", "mlflow"]`` writes the run's scalars (loss, learning rate, gradient
norm, samples/s, evaluations, each rank's memory and communication) once per step from the
kernel, with its configuration as hyperparameters, to TensorBoard events in ``log_dir``
(default ``runs/<name>``) and to MLflow (``MLFLOW_TRACKING_URI``, else a sqlite store in
``log_dir``); ``pip install 'axon_nb[track]'`` brings both.

Ctrl-C stops every rank at the same step boundary and returns the result so far. Example::

    from axon_nb import DDP
    result = cluster.train(
        model=make_model, data=make_dataset, strategy=DDP(comm_hook="bf16"),
        optimizer=("adamw", {"lr": 3e-4}), loss=torch.nn.functional.cross_entropy,
        steps=200, batch_size=32, grad_accum=2, mixed_precision="bf16",
        clip_grad_norm=1.0, seed=0,
    )
    result.losses[-1]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.validation import check_world
from axon_nb.train.dask_data import partitions
from axon_nb.train.expert_check import check_experts
from axon_nb.train.handle import TrainHandle
from axon_nb.train.recovery import train_with_restarts
from axon_nb.train.result import TrainResult
from axon_nb.train.start import start_run
from axon_nb.train.tracking import ending, open_tracker
from axon_nb.widgets.frontend import in_notebook

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.spec.train_spec import TrainSpec
    from axon_nb.train.tracking import Tracker


def train(
    cluster: ClusterLike, spec: TrainSpec, *, block: bool = True
) -> TrainResult | TrainHandle:
    """Train ``spec`` on every rank of ``cluster``: what ``cluster.train(...)`` runs once it
    has built the spec (the module's docstring says what a run does with each option).

    Returns a :class:`TrainResult`, or with ``block=False`` a :class:`TrainHandle` at once.
    Example::

        spec = make_spec(DDP, model=make_model, data=ds, steps=100, batch_size=32)
        result = train(cluster, spec)
    """
    check_on_cluster(cluster, spec, block=block)
    tracker = open_tracker(spec) if spec.log_to else None
    if spec.max_restarts:
        return _with_restarts(cluster, spec, tracker)
    handle = start_run(cluster, spec, show=block and in_notebook())
    if tracker is not None:
        tracker.follow(handle, len(cluster.targets()))
    if not block:
        return handle
    with ending(tracker, end=False):
        result = handle.wait()
    return result


def check_on_cluster(cluster: ClusterLike, spec: TrainSpec, *, block: bool) -> None:
    """Raise ``ValueError`` if ``spec`` cannot run on ``cluster`` as it is now (its world
    size, its experts, the dask collection's columns, the ranks running), before anything
    reaches the ranks. Example::

        check_on_cluster(cluster, spec, block=True)
    """
    check_world(spec, len(cluster.targets()), cluster.ranks_per_host)
    check_experts(cluster, spec)
    if is_dask_data(spec.data):
        partitions(spec.data, spec.columns)  # checks the columns before anything runs
    if spec.min_ranks is not None and spec.min_ranks > len(cluster.ranks):
        raise ValueError(
            f"min_ranks={spec.min_ranks} is more than the {len(cluster.ranks)} ranks running"
        )
    if spec.max_restarts and not block:
        raise ValueError(
            "max_restarts needs block=True: the kernel waits for the run to restart it"
        )


def _with_restarts(cluster: ClusterLike, spec: TrainSpec, tracker: Tracker | None) -> TrainResult:
    """The run, restarted from its newest checkpoint when a rank dies (``recovery``), as one
    tracked run through the restarts."""

    def start(continued: TrainSpec, notes: list[str]) -> TrainHandle:
        handle = start_run(cluster, continued, show=in_notebook(), notes=notes)
        if tracker is not None:
            tracker.follow(handle, len(cluster.targets()), last=False)
        return handle

    with ending(tracker, end=True):
        result = train_with_restarts(cluster, spec, start)
    return result
