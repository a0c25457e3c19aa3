"""``start_run``: send a training spec to every rank and return its handle at once (used by
``train``, ``compare`` and recovery)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from axon_nb.rank import entry
from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.train_spec import TrainSpec
from axon_nb.train import notebook_data
from axon_nb.train.dask_data import place
from axon_nb.train.handle import TrainHandle

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike, Sent


def start_run(
    cluster: ClusterLike,
    spec: TrainSpec,
    *,
    show: bool,
    notes: Sequence[str] = (),
    label: str | None = None,
) -> TrainHandle:
    """Send ``spec`` to every rank and return the run's handle at once."""
    work, run = send_run(cluster, spec)
    handle = TrainHandle(cluster, work, spec, run, label=label)
    for note in notes:
        handle.dashboard.note(note)
    cluster.last_run = handle
    if show:
        handle.show()
    return handle


def send_run(cluster: ClusterLike, spec: TrainSpec) -> tuple[Sent, str]:
    """Send ``spec`` to every rank (its data shared or placed first); the sent work and the
    run's id (its publications carry it). Example::

        sent, run = send_run(cluster, spec)
    """
    targets = cluster.targets()
    run = uuid.uuid4().hex[:12]
    sent = spec
    if is_dask_data(spec.data):  # each rank gets only where its rows are
        dims = spec.strategy.dims(len(targets), cluster.ranks_per_host)
        shards, held = place(cluster, spec.data, spec.columns, dims, spec.batch_size // dims.dp)
        cluster.hold_dask_rows(held)
        sent = dataclasses.replace(spec, data=shards)
    elif (shared := notebook_data.share(cluster, spec.data)) is not None:
        sent = dataclasses.replace(spec, data=shared)  # its tensors held once per host
    if (shared_eval := notebook_data.share(cluster, spec.eval_data)) is not None:
        sent = dataclasses.replace(sent, eval_data=shared_eval)  # the same way as data
    if cluster.detached is not None:  # (for kernels that attach later)
        cluster.detached.note_run(spec.name, run, spec.steps, targets, spec.strategy.describe(),
                                  streams=spec.streams)  # fmt: skip
    return cluster.send(entry.train, sent, run), run  # (pickled once, with the call)
