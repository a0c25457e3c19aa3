"""The one place where parallel degrees are checked and the device mesh is built.

Ranks are laid out on a 3-D mesh ``(pp, dp, tp)``, tensor parallelism innermost (the ranks that
talk most sit next to each other, on one host when there are several)::

    rank = (pp_index * dp + dp_index) * tp + tp_index

Example::

    dims = ParallelDims(dp=2, tp=2, pp=1, world_size=4)
    dims.coords(3)            # {"pp": 0, "dp": 1, "tp": 1}
    mesh = dims.build_mesh("cpu")
    mesh["tp"]                # this rank's tensor-parallel group
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Degrees of pipeline (``pp``), data (``dp``) and tensor (``tp``) parallelism."""

    dp: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        bad = [f"{a}={getattr(self, a)!r}" for a in AXES if not _positive(getattr(self, a))]
        if bad:
            raise ValueError(f"parallel degrees must be positive integers, got {', '.join(bad)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"the parallel degrees must multiply to the world size: dp={self.dp} x "
                f"tp={self.tp} x pp={self.pp} = {self.dp * self.tp * self.pp}, but there are "
                f"{self.world_size} ranks. Choose degrees whose product is {self.world_size}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": rank // self.tp % self.dp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over all ranks, with axes named ``pp``, ``dp`` and ``tp``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=AXES)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
