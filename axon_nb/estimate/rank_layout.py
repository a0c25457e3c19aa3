"""What one rank holds and processes under a strategy: its layers, how its model state is
split, and how many samples' activations it keeps at once. The memory and communication
models (``memory_model``, ``comm_model``) read only this and the ``ModelProfile``.

Example::

    layout = rank_layouts(profile, FSDP(), world_size=4, batch_size=32)[0]
    layout.layers, layout.param_shards, layout.samples_in_flight
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.spec.parallel_config import ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.spec.pipeline_stages import balanced_starts, check_starts


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLayout:
    """One rank's share of the model and the batch."""

    rank: int
    dims: ParallelDims
    config: ParallelConfig
    stages: tuple[tuple[int, ...], ...]
    """Layer indices of each pipeline stage this rank runs (one stage without a pipeline)."""
    first_stage: bool
    last_stage: bool
    micro_samples: float
    """Samples of one micro-batch (pipeline) or accumulation step on this rank."""
    microbatches: int
    """Micro-batches (or accumulation steps) per step."""
    in_flight: float
    """Micro-batches whose activations this rank keeps at once (pipeline schedules)."""

    @property
    def kind(self) -> str:
        """The data-parallel technique: none, ddp, zero1, zero2 or fsdp."""
        return self.config.data_parallel if self.dims.dp > 1 else "none"

    @property
    def layers(self) -> list[int]:
        return [i for stage in self.stages for i in stage]

    @property
    def param_shards(self) -> int:
        """Over how many ranks this rank's parameters (and gradients) are sharded (with
        expert parallelism, its parameters but the experts)."""
        return self.dims.dp_shard * self.dims.ep if self.kind == "fsdp" else 1

    @property
    def optimizer_shards(self) -> int:
        if self.kind == "fsdp":
            return self.param_shards
        return self.dims.dp if self.kind in ("zero1", "zero2") else 1

    def experts(self, layers: list[LayerProfile]) -> float:
        """Expert parameters of ``layers`` that expert parallelism splits (0 without it: data
        parallelism then treats them as any other parameter)."""
        return sum(layer.expert_params for layer in layers) if self.dims.ep > 1 else 0.0

    @property
    def samples_in_flight(self) -> float:
        return self.micro_samples * self.in_flight


def rank_layouts(
    profile: ModelProfile,
    strategy: Any,
    world_size: int,
    batch_size: int,
    *,
    ranks_per_host: int = 1,
    grad_accum: int = 1,
) -> list[RankLayout]:
    """Every rank's layout (``ValueError`` when the strategy cannot run so)."""
    dims = strategy.dims(world_size, ranks_per_host)
    config: ParallelConfig = strategy.config()
    pipe = config.pipeline if dims.pp > 1 else None
    microbatches = pipe.microbatches if pipe is not None else grad_accum
    if batch_size % (dims.dp * microbatches):
        raise ValueError(
            f"batch_size={batch_size} does not split into {dims.dp} data-parallel ranks x "
            f"{microbatches} micro-batches"
        )
    bounds = _stage_bounds(profile.layers, dims.pp, pipe)
    stage_count = len(bounds) - 1
    layouts = []
    for rank in range(world_size):
        pp_index = dims.coords(rank)["pp"]
        mine = [s for s in range(stage_count) if s % dims.pp == pp_index]
        layouts.append(
            RankLayout(
                rank=rank,
                dims=dims,
                config=config,
                stages=tuple(tuple(range(bounds[s], bounds[s + 1])) for s in mine),
                first_stage=0 in mine,
                last_stage=stage_count - 1 in mine,
                micro_samples=batch_size / dims.dp / microbatches,
                microbatches=microbatches,
                in_flight=_in_flight(pipe, pp_index, dims.pp, microbatches),
            )
        )
    return layouts


def _stage_bounds(layers: tuple[LayerProfile, ...], pp: int, pipe: Any) -> list[int]:
    if pipe is None:
        return [0, len(layers)]
    stages = pp * pipe.virtual_stages
    if pipe.split_points is not None:
        starts = check_starts(pipe.split_points, len(layers), stages)
    else:
        starts = balanced_starts([layer.params for layer in layers], stages)
    return [*starts, len(layers)]


def _in_flight(pipe: Any, pp_index: int, pp: int, microbatches: int) -> float:
    """Micro-batches whose activations are alive at once on pipeline rank ``pp_index``.

    GPipe runs every forward before any backward. 1F1B warms up with ``pp - i`` forwards on
    rank i, then runs one backward before each further forward. Interleaved 1F1B (``v``
    stages per rank) warms up with ``(v - 1) pp + 2 (pp - 1 - i)`` forwards of one of its
    stages, each ``1 / v`` of the rank's layers, and holds one more before its first backward.
    """
    if pipe is None:
        return 1
    if pipe.schedule == "1f1b":
        return min(microbatches, pp - pp_index)
    if pipe.schedule == "interleaved_1f1b":
        v = pipe.virtual_stages
        warmup = (v - 1) * pp + 2 * (pp - 1 - pp_index)
        return min(microbatches, (warmup + 1) / v)
    return microbatches
