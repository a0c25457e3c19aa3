"""``Hybrid``: data, tensor and pipeline parallelism together, over one 3-D device mesh."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import MicroStep, Strategy
from axon_nb.strategies.pipeline import Pipeline
from axon_nb.strategies.tensor import TensorParallel

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext


@dataclass(frozen=True, kw_only=True, slots=True)
class Hybrid(Strategy):
    """``dp`` x ``tp`` x ``pp`` ranks on one mesh (``axon_nb.parallel.dims``): the model is cut
    into ``pp`` pipeline stages, each stage's layers are split over ``tp`` ranks, and each of
    those is sharded over ``dp`` data-parallel ranks with FSDP (full_shard, ZeRO-3).

    The degrees must multiply to the world size. Pipeline and tensor-parallel options are
    those of :class:`Pipeline` and :class:`TensorParallel`.

    Example::

        from axon_nb import Hybrid
        cluster.train(model=GPT, data=ds, loss=lm_loss, steps=100, batch_size=32,
                      strategy=Hybrid(dp=2, tp=2, pp=2, microbatches=4))
    """

    name: ClassVar[str] = "hybrid"

    dp: int = 1
    """Data-parallel degree (FSDP over these ranks)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages, times ``virtual_stages``)."""
    plan: dict[str, str] | None = None
    """Tensor-parallel plan (see :class:`TensorParallel`)."""
    sequence_parallel: bool = False
    """Sequence parallelism in the tensor-parallel layers (not with ``pp > 1`` yet)."""
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split_points: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._pipeline_config()  # checks the pipeline options
        TensorParallel(plan=self.plan, sequence_parallel=self.sequence_parallel)
        if self.sequence_parallel and self.pp > 1:
            raise ValueError(
                "sequence_parallel with pipeline stages (pp > 1) is not supported yet: use "
                "sequence_parallel=False, or pp=1"
            )

    def _pipeline_config(self) -> Pipeline:
        return Pipeline(
            microbatches=self.microbatches,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            split_points=self.split_points,
        )

    def _degrees(self, world_size: int) -> Any:
        from axon_nb.parallel.dims import ParallelDims

        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, world_size=world_size)

    def check_world(self, world_size: int) -> None:
        self._degrees(world_size)

    def check_spec(self, spec: Any, world_size: int) -> None:
        if self.pp > 1:
            Pipeline.check_spec(self, spec, world_size)  # type: ignore[arg-type]

    def data_parallel(self, rank: int, world_size: int) -> tuple[int, int]:
        dims = self._degrees(world_size)
        return dims.coords(rank)["dp"], dims.dp

    def loss_share(self, rank: int, world_size: int) -> float:
        return Pipeline.loss_share(self, rank, world_size)  # type: ignore[arg-type]

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        dims = self._degrees(ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        tensor = TensorParallel(plan=self.plan, sequence_parallel=self.sequence_parallel)

        def prepare(root: nn.Module, parts: list[nn.Module]) -> list[nn.Module]:
            if self.tp > 1:
                owned = {n for part in parts for n, m in root.named_modules() if _inside(m, part)}
                tensor.apply(root, mesh["tp"], owned)
            if self.dp > 1:
                parts = [_shard(part, mesh["dp"]) for part in parts]
            return parts

        if self.pp > 1:
            return self._pipeline_config()._pipeline(model, ctx, dims, mesh, prepare)
        return prepare(model, [model])[0]

    def forward_backward(
        self, model: nn.Module, microbatches: Sequence[Any], step: MicroStep
    ) -> torch.Tensor:
        if self.pp > 1:
            return self._pipeline_config().forward_backward(model, microbatches, step)
        return Strategy.forward_backward(self, model, microbatches, step)

    def no_sync(self, model: nn.Module) -> Any:
        import contextlib

        from axon_nb.strategies.fsdp import FSDP

        if self.dp > 1 and self.pp == 1:
            return FSDP().no_sync(model)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from axon_nb.parallel.grads import clip_grad_norm_

        group = getattr(model, "pp_group", None)
        return clip_grad_norm_(model.parameters(), max_norm, group=group)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "root", model)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's parameters on every rank (a collective)."""
        if self.pp > 1:
            return self._pipeline_config().state_dict(model)
        return {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()
        }

    def report(self, model: nn.Module) -> dict[str, Any]:
        return dict(getattr(model, "last_step", {}))

    def get_state(self, model: nn.Module, optimizer: Any, *, full: bool) -> dict[str, Any]:
        if self.pp > 1:
            return self._pipeline_config().get_state(model, optimizer, full=full)
        return Strategy.get_state(self, model, optimizer, full=full)

    def set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        if self.pp > 1:
            return self._pipeline_config().set_state(model, optimizer, state)
        return Strategy.set_state(self, model, optimizer, state)


def _inside(module: nn.Module, part: nn.Module) -> bool:
    return any(module is m for m in part.modules())


def _shard(part: nn.Module, dp_mesh: Any) -> nn.Module:
    """FSDP over the data-parallel ranks: each block of the part as a unit, then the part.

    Blocks are the entries of the part's ``ModuleList`` (a whole model), or the layers of a
    pipeline stage that hold parameters.
    """
    from torch import nn as torch_nn
    from torch.distributed.fsdp import fully_shard

    from axon_nb.parallel.fsdp import wrap_targets

    units = wrap_targets(part, None, None)
    if not units and isinstance(part, torch_nn.Sequential):
        units = [layer for layer in part if any(True for _ in layer.parameters())]
    for unit in units:
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(part, mesh=dp_mesh)
    return part
