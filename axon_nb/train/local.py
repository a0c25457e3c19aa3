"""``train_local``: the ranks' training loop in this process, world size 1, as a reference."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.make import make_spec
from axon_nb.spec.train_spec import TrainSpec, spec_options
from axon_nb.spec.validation import check_world
from axon_nb.strategies import SingleDevice
from axon_nb.train import dask_data
from axon_nb.train.result import TrainResult, build_result

if TYPE_CHECKING:
    from axon_nb.rank.runtime import RankContext


def train_local(
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
    eval_data: Any = None,
    eval_every: int | None = None,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    device: str = "cpu",
) -> TrainResult:
    """Run ``cluster.train``'s loop in this process on one ``device`` (default: the CPU).

    Same arguments and data order as ``cluster.train``, so with the same ``batch_size`` and
    ``seed`` it is the single-process reference a distributed run should match. The strategy
    defaults to :class:`~axon_nb.strategies.SingleDevice` (no wrapping); another strategy runs
    in a one-rank gloo world. ``result.model`` is the trained module. Example::

        ref = axon_nb.train_local(model=make_model, data=ds, steps=20, batch_size=32)
        ref.losses[-1], ref.model
    """
    return run_local(make_spec(SingleDevice, **spec_options(locals())), device=device)


def run_local(spec: TrainSpec, *, device: str = "cpu") -> TrainResult:
    """Train ``spec`` in this process on ``device``: what ``train_local`` runs once it has
    built the spec. Example::

        result = run_local(make_spec(SingleDevice, model=make_model, data=ds, steps=20,
                                     batch_size=32))
    """
    from axon_nb.rank.training.loop import run

    check_world(spec, 1)
    if is_dask_data(spec.data):  # the whole collection, computed here as one rank's pieces
        local = dask_data.local(spec.data, spec.columns, spec.batch_size)
        spec = dataclasses.replace(spec, data=local)
    with _one_rank_world(needed=not isinstance(spec.strategy, SingleDevice)):
        summary, state = run(spec, _one_rank(device), sink=None, run_id="local")
    assert state is not None
    return build_result(
        [summary], name=spec.name, strategy=spec.strategy.describe(), model=state.module
    )


def _one_rank(device: str) -> RankContext:
    """The context of rank 0 of a world of one, on ``device``."""
    import torch

    from axon_nb.rank.runtime import RankContext

    return RankContext(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        host="localhost",
        pid=0,
        device=torch.device(device),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=0,
        timeout_s=300.0,
    )


@contextlib.contextmanager
def _one_rank_world(needed: bool) -> Iterator[None]:
    """A one-rank gloo process group for strategies that need one, unless one exists."""
    import torch.distributed as dist

    if not needed or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
