"""``train``: a training run on a cluster's ranks, the whole loop there."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.train_spec import TrainSpec, check_world, make_spec
from axon_nb.strategies import DDP
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


def train(
    cluster: ClusterLike,
    model: Any = None,
    data: Any = None,
    *,
    strategy: Any = None,
    columns: tuple[Any, Any] | None = None,
    optimizer: Any = None,
    param_groups: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
    no_decay: str | None = None,
    loss: Callable[..., Any] | None = None,
    loss_normalization: str = "mean",
    steps: int,
    batch_size: int,
    grad_accum: int = 1,
    mixed_precision: str | None = None,
    clip_grad_norm: float | None = None,
    loader: dict[str, Any] | None = None,
    compile: bool = False,
    schedule: str = "constant",
    warmup_steps: int = 0,
    scheduler: Callable[..., Any] | None = None,
    seed: int = 0,
    resume: bool = False,
    name: str = "model",
    metrics_interval_s: float = 0.5,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    checkpoint_every_s: float | None = None,
    keep: int | None = None,
    max_restarts: int = 0,
    min_ranks: int | None = None,
    eval_data: Any = None,
    eval_every: int | None = None,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    log_to: str | Sequence[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    trace: tuple[int, int] | None = None,
    block: bool = True,
) -> TrainResult | TrainHandle:
    """Train ``model`` on every rank of ``cluster`` with ``strategy`` (default ``DDP()``).

    ``batch_size`` is the global batch per optimizer step: each data-parallel rank takes
    ``batch_size / dp`` samples of its own data shard, in ``grad_accum`` micro-batches. The
    trained model stays on the ranks as ``name`` (a ``%%axon`` cell can evaluate it; names
    that would shadow ``rank``, ``device``, builtins or ``torch`` are refused), and
    ``resume=True`` continues it (model, optimizer, step, data order), taking new optimizer
    settings such as ``optimizer=("adamw", {"lr": 1e-4})``.

    With ``checkpoint_dir``, a sharded checkpoint is written there every ``checkpoint_every``
    steps and/or ``checkpoint_every_s`` seconds, in the background (only the newest ``keep``
    stay); with ``max_restarts``, a rank that dies makes the kernel restart the ranks, load
    the newest checkpoint and train on to the same step count (``result.restarts``). With
    ``min_ranks``, a rank that cannot come back (the restart fails, or the same rank dies
    again) is left out: training goes on with fewer ranks, at least ``min_ranks``, where the
    strategy's layout and ``batch_size`` allow it.

    ``data`` may be a dask DataFrame (with ``columns=(features, target)``), a pair of dask
    Arrays ``(inputs, targets)`` or a Bag of ``(input, target)`` items: its partitions are
    computed on the ranks' own dask workers (``cluster.dask()``, started on demand), each
    rank keeping only its share; the rows never pass through the kernel.

    ``compile=True`` compiles each of the model's blocks with ``torch.compile`` before it is
    sharded. On GPU ranks Adam and AdamW use PyTorch's fused kernels unless ``fused`` or
    ``foreach`` is given, and the loop never waits for the GPU within a step: the ranks'
    agreement (loss, stop) is read one step later and the next batch is copied ahead.

    ``log_to=["tensorboard", "mlflow"]`` writes the run's scalars (loss, learning rate,
    gradient norm, samples/s, evaluations, each rank's memory and communication) once per step
    from the kernel, with its configuration as hyperparameters, to TensorBoard events in
    ``log_dir`` (default ``runs/<name>``) and to MLflow (``MLFLOW_TRACKING_URI``, else a
    sqlite store in ``log_dir``); ``pip install 'axon_nb[track]'`` brings both.

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
        columns=columns,
        optimizer=optimizer,
        param_groups=param_groups,
        no_decay=no_decay,
        loss=loss,
        loss_normalization=loss_normalization,
        steps=steps,
        batch_size=batch_size,
        grad_accum=grad_accum,
        mixed_precision=mixed_precision,
        clip_grad_norm=clip_grad_norm,
        loader=loader,
        compile=compile,
        schedule=schedule,
        warmup_steps=warmup_steps,
        scheduler=scheduler,
        seed=seed,
        resume=resume,
        name=name,
        metrics_interval_s=metrics_interval_s,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        checkpoint_every_s=checkpoint_every_s,
        keep=keep,
        max_restarts=max_restarts,
        min_ranks=min_ranks,
        eval_data=eval_data,
        eval_every=eval_every,
        metrics=metrics,
        log_to=log_to,
        log_dir=log_dir,
        trace=trace,
    )
    check_world(spec, len(cluster.targets()), cluster.ranks_per_host)
    check_experts(cluster, spec)
    if is_dask_data(spec.data):
        partitions(spec.data, spec.columns)  # checks the columns before anything runs
    elif spec.columns is not None:
        raise ValueError("columns= names a dask DataFrame's columns; data= is not one")
    if spec.min_ranks is not None and spec.min_ranks > len(cluster.ranks):
        raise ValueError(
            f"min_ranks={spec.min_ranks} is more than the {len(cluster.ranks)} ranks running"
        )
    if spec.max_restarts and not block:
        raise ValueError(
            "max_restarts needs block=True: the kernel waits for the run to restart it"
        )
    if spec.max_restarts and (spec.model is None or spec.data is None):
        raise ValueError(
            "max_restarts rebuilds the run on fresh ranks: pass model= and data= (also "
            "with resume=True)"
        )
    tracker = open_tracker(spec) if spec.log_to else None
    if spec.max_restarts:

        def start(continued: TrainSpec, notes: list[str]) -> TrainHandle:
            handle = start_run(cluster, continued, show=in_notebook(), notes=notes)
            if tracker is not None:  # one tracked run through the restarts
                tracker.follow(handle, len(cluster.targets()), last=False)
            return handle

        with ending(tracker, end=True):
            result = train_with_restarts(cluster, spec, start)
        return result
    handle = start_run(cluster, spec, show=block and in_notebook())
    if tracker is not None:
        tracker.follow(handle, len(cluster.targets()))
    if not block:
        return handle
    with ending(tracker, end=False):
        result = handle.wait()
    return result
