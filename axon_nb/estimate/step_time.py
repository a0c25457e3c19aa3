"""Predicted time of one training step on one rank: compute at the device's throughput plus
the communication that does not overlap it, at the links' bus bandwidth.

- Compute: the profile's FLOPs per sample x this rank's samples x its share of the model
  (its pipeline stage; tensor parallelism splits the split layers' work), x 4/3 with
  activation checkpointing (forward again in backward), and a pipeline's bubble,
  ``(microbatches + pp - 1) / microbatches``.
- Communication: each collective's bytes (``comm_model.comm_by_axis``) converted to time as
  nccl-tests defines bus bandwidth: all-reduce moves ``2(n-1)/n`` of its payload per rank,
  all-gather ``n-1`` shards, reduce-scatter ``(n-1)/n``, broadcast and send/recv all of it.
  Data-parallel collectives overlap backward (two thirds of the compute): only what exceeds
  it counts. Tensor- and pipeline-parallel ones sit on the critical path, and so does
  DiLoCo's outer all-reduce (in the optimizer's step, after backward). AsyncSGD's gradient
  all-reduce runs behind the whole step (forward too), not only backward; staleness hides a
  slow step, not bandwidth: each step still moves its own all-reduce.
- Links: ``intra_host`` for groups within one host, ``inter_host`` for groups that span hosts
  (the mesh puts tensor parallelism innermost, so it spans hosts last).

Example::

    step_time(profile, layout, Links(intra_host=150e9, inter_host=12e9), device_flops=300e12)
"""

from __future__ import annotations

from dataclasses import dataclass

from axon_nb.estimate.comm_model import comm_by_axis
from axon_nb.estimate.profile import ModelProfile
from axon_nb.estimate.rank_layout import RankLayout
from axon_nb.spec.collectives import bus_factor

OVERLAP = 2 / 3
"""Share of the compute (backward) that data-parallel communication can hide behind."""


@dataclass(frozen=True, slots=True)
class Links:
    """Bus bandwidth in bytes/s within a host and between hosts."""

    intra_host: float
    inter_host: float


def step_time(
    profile: ModelProfile,
    layout: RankLayout,
    links: Links,
    *,
    device_flops: float,
    ranks_per_host: int,
) -> dict[str, float]:
    """``compute_s``, ``comm_s`` (all of it), ``exposed_comm_s`` and ``step_s`` for one rank."""
    compute = _compute_s(profile, layout, device_flops)
    config = layout.config
    stale = config.async_sgd is not None and config.async_sgd.staleness > 0
    hidden_by = compute * (1.0 if stale else OVERLAP)  # (AsyncSGD: behind the whole step)
    overlappable, critical = 0.0, 0.0
    for (axis, kind), nbytes in comm_by_axis(profile, layout).items():
        size = _group_size(layout, axis)
        if size < 2:
            continue
        seconds = nbytes * _bus_factor(kind, size) / _link(layout, axis, links, ranks_per_host)
        outer = config.diloco is not None and axis in ("dp", "dp_replicate")  # (in the step)
        if axis.startswith("dp") and not outer:
            overlappable += seconds
        else:
            critical += seconds
    exposed = max(0.0, overlappable - hidden_by) + critical
    return {
        "compute_s": compute,
        "comm_s": overlappable + critical,
        "exposed_comm_s": exposed,
        "step_s": compute + exposed,
    }


def _compute_s(profile: ModelProfile, layout: RankLayout, device_flops: float) -> float:
    tp = layout.dims.tp
    total = sum(layer.params for layer in profile.layers) or 1
    share = sum(profile.layers[i].local_params(tp) for i in layout.layers) / total
    samples = layout.micro_samples * layout.microbatches
    seconds = profile.flops * samples * share / device_flops
    if layout.config.activation_checkpointing:
        seconds *= 4 / 3
    if layout.dims.pp > 1:
        seconds *= (layout.microbatches + layout.dims.pp - 1) / layout.microbatches
    return seconds


def _group_size(layout: RankLayout, axis: str) -> int:
    dims = layout.dims
    return {
        "dp": dims.dp,
        "dp_shard": dims.dp_shard * dims.ep,  # (FSDP shards over the expert ranks too)
        "dp_replicate": dims.dp_replicate,
        "ep": dims.ep,
        "edp": dims.edp,
        "tp": dims.tp,
        "pp": dims.pp,
        "world": dims.world_size,
    }[axis]


def _bus_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per payload byte: nccl-tests' factor, whose size is the whole
    buffer; an all-gather's payload here is one rank's shard, 1/n of its buffer."""
    return bus_factor(kind, n) * (n if kind == "all_gather" else 1)


def _link(layout: RankLayout, axis: str, links: Links, ranks_per_host: int) -> float:
    """The group's link: within a host when its ranks' span (stride x size) fits in one."""
    dims = layout.dims
    inner = {"tp": 1, "ep": dims.tp, "dp_shard": dims.tp, "dp": dims.tp, "edp": dims.tp * dims.ep,
             "dp_replicate": dims.tp * dims.dp_shard * dims.ep, "pp": dims.tp * dims.dp,
             "world": 1}[axis]  # fmt: skip
    span = inner * _group_size(layout, axis) if axis != "world" else dims.world_size
    return links.intra_host if span <= ranks_per_host else links.inter_host
