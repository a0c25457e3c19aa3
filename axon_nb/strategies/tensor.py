"""``TensorParallel``: tensor (and sequence) parallelism over all ranks, on DTensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import ParallelConfig, TensorConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class TensorParallel(Strategy, TensorConfig):
    """Split the model's linear layers over the ranks (``torch.distributed.tensor.parallel``).

    - ``plan``: module-name patterns to ``"colwise"`` / ``"rowwise"`` (or transformers'
      style names, or torch ``ParallelStyle`` objects; ``"auto"``: the model's own
      ``base_model_tp_plan``) (see
      ``axon_nb.parallel.tensor``); by default the model's ``ColumnParallelLinear`` /
      ``RowParallelLinear`` layers, or the reference GPT's plan (attention q/k/v column, out
      row; MLP up column, down row).
    - ``sequence_parallel``: norms work on sequence shards between the parallel layers.

    Every rank sees the same data; the loss is the same on every rank. The options are
    :class:`~axon_nb.spec.parallel_config.TensorConfig`'s.

    Example::

        from axon_nb import TensorParallel
        cluster.train(model=GPT, data=ds, strategy=TensorParallel(sequence_parallel=True),
                      steps=100, batch_size=32)
        TensorParallel(plan={"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
        TensorParallel(plan="auto")  # a transformers model's own plan
    """

    name: ClassVar[str] = "tensor"

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *TensorConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        return ParallelDims(tp=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor=config_from(TensorConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
