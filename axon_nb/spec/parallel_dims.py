"""``ParallelDims``: the one place that knows how the ranks are laid out.

Ranks sit on a 5-D mesh ``(pp, dp_replicate, dp_shard, ep, tp)``, tensor parallelism
innermost (the ranks that talk most are neighbours, on one host when there are several)::

    rank = (((pp_index * dp_replicate + replicate) * dp_shard + shard) * ep + ep_index) * tp
           + tp_index

Data parallelism is ``dp = dp_replicate x dp_shard x ep``: every one of those ranks reads its
own data. Plain data parallelism (DDP, ZeRO-1/2) and FSDP use the flattened ``dp`` axis;
FSDP's hybrid sharding shards over ``dp_shard`` and replicates over ``dp_replicate``.
Expert parallelism splits a mixture-of-experts model's experts over the ``ep`` ranks (tokens
travel to their experts by all-to-all); each expert is replicated over the ``edp`` ranks
(``dp_replicate x dp_shard``), everything else over all of ``dp``.

Pure Python: the kernel validates degrees with it; only :meth:`ParallelDims.mesh` imports torch.

Example::

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
    dims.coords(3)            # {"pp": 0, "dp_shard": 1, "dp": 1, "tp": 1, ... the rest 0}
    dims.data_rank(3)         # (1, 2): reads the second of two data shards
    mesh = dims.mesh("cpu")   # mesh["tp"], mesh["pp"], mesh["dp_replicate", "dp_shard"]
    dims.dp_mesh("cpu")       # all data-parallel ranks, flattened
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "tp")


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Degrees of pipeline, data (replicated x sharded), expert and tensor parallelism."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP's ranks, or FSDP hybrid sharding's groups)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the model state among themselves (FSDP, ZeRO)."""
    ep: int = 1
    """Expert-parallel degree: ranks that split the experts (and read different data)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (ranks along the pipeline, not stages)."""
    world_size: int
    _meshes: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        bad = [f"{a}={getattr(self, a)!r}" for a in AXES if not positive(getattr(self, a))]
        if bad:
            raise ValueError(f"parallel degrees must be positive integers, got {', '.join(bad)}")
        product = self.pp * self.dp * self.tp
        if product != self.world_size:
            parts = [f"{a}={getattr(self, a)}" for a in AXES[1:4] if getattr(self, a) > 1]
            split = f" (dp = {' x '.join(parts)})" if len(parts) > 1 else ""
            raise ValueError(
                f"the parallel degrees must multiply to the world size: dp={self.dp} x "
                f"tp={self.tp} x pp={self.pp} = {product}, but there are {self.world_size} "
                f"ranks{split}. Choose degrees whose product is {self.world_size}"
            )

    @property
    def dp(self) -> int:
        """All data-parallel ranks: ``dp_replicate x dp_shard x ep``."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each axis, and along the flattened ``dp`` axis."""
        tp_index = rank % self.tp
        ep_index = rank // self.tp % self.ep
        shard = rank // (self.tp * self.ep) % self.dp_shard
        replicate = rank // (self.tp * self.ep * self.dp_shard) % self.dp_replicate
        pp_index = rank // (self.tp * self.dp)
        return {
            "pp": pp_index,
            "dp_replicate": replicate,
            "dp_shard": shard,
            "ep": ep_index,
            "dp": (replicate * self.dp_shard + shard) * self.ep + ep_index,
            "tp": tp_index,
        }

    def data_rank(self, rank: int) -> tuple[int, int]:
        """``(index, size)`` of ``rank``'s data shard: ranks with the same index read the same
        samples (tensor-parallel peers and pipeline stages of one replica do)."""
        return self.coords(rank)["dp"], self.dp

    def loss_share(self, rank: int) -> float:
        """Weight of ``rank``'s loss in the global mean loss: the last pipeline stage computes
        it, the same on every tensor-parallel peer; other stages compute none."""
        if self.coords(rank)["pp"] != self.pp - 1:
            return 0.0
        return 1.0 / (self.dp * self.tp)

    def mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over all ranks, with the axes of :data:`AXES` (``ep`` only with
        expert parallelism; built once, then cached)."""
        return self._build(device_type)[0]

    def dp_mesh(self, device_type: str) -> Any:
        """The flattened data-parallel axis ``dp_replicate x dp_shard x ep`` (a 1-D mesh)."""
        return self._build(device_type)[1]

    def edp_mesh(self, device_type: str) -> Any:
        """The flattened ``dp_replicate x dp_shard`` axis: the replicas of each expert."""
        return self._build(device_type)[2]

    def _build(self, device_type: str) -> tuple[Any, Any, Any]:
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            # Without expert parallelism the mesh has no ep axis: every axis is a process group
            # (gloo: three threads and sockets each, for the life of the world).
            axes = AXES if self.ep > 1 else tuple(a for a in AXES if a != "ep")
            shape = tuple(getattr(self, a) for a in axes)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=axes)
            # Kept here: PyTorch asks that a flattened axis be held, not sliced from the root.
            dp_axes = ("dp_replicate", "dp_shard", "ep") if self.ep > 1 else axes[1:3]
            dp = mesh[dp_axes]._flatten("dp")
            edp = mesh["dp_replicate", "dp_shard"]._flatten("edp") if self.ep > 1 else dp
            self._meshes[device_type] = (mesh, dp, edp)
        return self._meshes[device_type]


def positive(value: Any) -> bool:
    """True for an ``int`` (not a bool) >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
