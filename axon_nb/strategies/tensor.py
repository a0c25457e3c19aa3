"""``TensorParallel``: tensor (and sequence) parallelism over all ranks, on DTensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext


STYLES = ("colwise", "rowwise")
"""Plan styles: split a linear layer's output features (colwise) or input features (rowwise)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallel(Strategy):
    """Split the model's linear layers over the ranks (``torch.distributed.tensor.parallel``).

    - ``plan``: module-name patterns to ``"colwise"`` / ``"rowwise"`` (see
      ``axon_nb.parallel.tensor``); by default the model's ``ColumnParallelLinear`` /
      ``RowParallelLinear`` layers, or the reference GPT's plan (attention q/k/v column, out
      row; MLP up column, down row).
    - ``sequence_parallel``: norms work on sequence shards between the parallel layers.

    Every rank sees the same data; the loss is the same on every rank.

    Example::

        from axon_nb import TensorParallel
        cluster.train(model=GPT, data=ds, strategy=TensorParallel(sequence_parallel=True),
                      steps=100, batch_size=32)
        TensorParallel(plan={"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
    """

    name: ClassVar[str] = "tensor"

    plan: dict[str, str] | None = None
    """Module-name pattern -> ``"colwise"`` | ``"rowwise"``; None: the default plan."""
    sequence_parallel: bool = False
    """Shard norms (and the residual stream) along the sequence between parallel layers."""

    def __post_init__(self) -> None:
        if self.plan is None:
            return
        bad = (
            {k: v for k, v in self.plan.items() if v not in STYLES}
            if isinstance(self.plan, dict)
            else self.plan
        )
        if bad:
            raise ValueError(
                f"plan maps module-name patterns to 'colwise' or 'rowwise'; got {bad!r}"
            )

    def _degrees(self, world_size: int) -> Any:
        from axon_nb.parallel.dims import ParallelDims

        return ParallelDims(dp=1, tp=world_size, pp=1, world_size=world_size)

    def data_parallel(self, rank: int, world_size: int) -> tuple[int, int]:
        return 0, 1  # every tensor-parallel rank reads the same samples

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        mesh = self._degrees(ctx.world_size).build_mesh(ctx.device.type)
        return self.apply(model, mesh["tp"])

    def apply(self, model: nn.Module, tp_mesh: Any, owned: Any = None) -> nn.Module:
        """Parallelize ``model`` over ``tp_mesh`` (only modules in ``owned``, when given)."""
        from axon_nb.parallel.tensor import apply_tensor_parallel, default_plan, resolve_plan

        plan = resolve_plan(model, self.plan or default_plan(model), tp_mesh.size())
        if owned is not None:
            plan = {name: style for name, style in plan.items() if name in owned}
        return apply_tensor_parallel(model, tp_mesh, plan, sequence_parallel=self.sequence_parallel)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from axon_nb.parallel.grads import clip_grad_norm_

        return clip_grad_norm_(model.parameters(), max_norm)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Full parameters on every rank (a collective: sharded layers are gathered)."""
        return {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()
        }
