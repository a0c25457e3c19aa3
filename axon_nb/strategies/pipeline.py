"""``Pipeline``: pipeline parallelism (``torch.distributed.pipelining``) over all ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from axon_nb.spec.parallel_config import ParallelConfig, PipelineConfig
from axon_nb.spec.parallel_dims import ParallelDims
from axon_nb.strategies.base import Strategy, config_from


@dataclass(frozen=True, kw_only=True, repr=False)
class Pipeline(Strategy, PipelineConfig):
    """Cut the model into stages, one per rank (or ``virtual_stages`` per rank), and run
    micro-batches through them with a pipeline schedule.

    - ``schedule``: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one forward,
      one backward: fewer activations alive) or ``"interleaved_1f1b"`` (``virtual_stages``
      stages per rank, a smaller bubble).
    - Stages are cut from an ``nn.Sequential``'s children, a model's ``pipeline_layers()``, a
      transformers model's own pipeline plan (``base_model_pp_plan``: embeddings, each
      decoder layer, norm, head) or the module names in ``split``; balanced by parameter
      count, or at ``split_points`` (the first layer of each stage after the first). For
      explicit stage modules, pass ``nn.Sequential(stage0, stage1, ...)``, one stage a child.
    - The loss is computed on the last stage (``loss=`` of ``train``; with ``loss=None`` and
      dict batches, a transformers model's own ``loss_function`` on ``labels``); the global
      loss is its mean. Each rank holds only its stages' parameters.

    Besides ``num_stages``, the options are
    :class:`~axon_nb.spec.parallel_config.PipelineConfig`'s.

    Example::

        from axon_nb import Pipeline
        from axon_nb.models import GPT, lm_loss
        cluster.train(model=GPT, data=ds, loss=lm_loss, steps=100, batch_size=32,
                      strategy=Pipeline(microbatches=8, schedule="1f1b"))
    """

    name: ClassVar[str] = "pipeline"

    num_stages: int | None = None
    """Total stages; it must be ranks x ``virtual_stages`` (the default)."""

    def problems(self) -> list[str]:
        return [*Strategy.problems(self), *PipelineConfig.problems(self)]

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        expected = world_size * self.virtual_stages
        if self.num_stages is not None and self.num_stages != expected:
            ranks = max(1, self.num_stages // self.virtual_stages)
            raise ValueError(
                f"Pipeline(num_stages={self.num_stages}) on {world_size} ranks with "
                f"virtual_stages={self.virtual_stages}: each rank runs virtual_stages stages, so "
                f"num_stages must be {expected}. Start {ranks} ranks, or change virtual_stages"
            )
        return ParallelDims(pp=world_size, world_size=world_size)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            pipeline=config_from(PipelineConfig, self),
            activation_checkpointing=self._checkpoint_every(),
        )
