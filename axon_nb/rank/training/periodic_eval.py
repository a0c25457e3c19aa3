"""Evaluation during training (``eval_data=``, ``eval_every=``, ``metrics=``): which steps
evaluate, on what, and a check of the first batch before the run trains.

The evaluation set is split over the data-parallel ranks like ``cluster.evaluate``'s
(``evaluation.py``), one training micro-batch of samples per forward, under the run's
autocast, batched by the run's ``loader={"collate_fn": ...}`` when it has one. Evaluated
steps: every ``eval_every``-th global step, and the call's last step.
Example (what the loop does)::

    evals = PeriodicEval(spec, ctx, state, autocast, last_step=100)
    evals.check()                       # before the first step: a metric's shape, ...
    record |= evals.after_step(state.step, meter)  # {"eval": {"loss", "acc", "samples"}}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from axon_nb.metrics.comm import CommMeter
from axon_nb.rank import runtime
from axon_nb.rank.data.shards import resolve_dataset
from axon_nb.rank.training.evaluation import evaluate_model
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.spec.train_spec import TrainSpec


class PeriodicEval:
    """A run's evaluations (one per due step)."""

    def __init__(
        self,
        spec: TrainSpec,
        ctx: runtime.RankContext,
        state: TrainState,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
        *,
        last_step: int,
    ) -> None:
        self.spec, self.ctx, self.state, self.autocast = spec, ctx, state, autocast
        self.every = spec.eval_every
        self.last_step = last_step
        self.dataset = resolve_dataset(spec.eval_data, ctx.rank)
        dp = state.parallel.dims.dp
        self.batch_size = max(1, spec.batch_size // (dp * spec.grad_accum))
        """Samples per forward on each data-parallel rank: a training micro-batch."""

    def due(self, step: int) -> bool:
        """Whether the run evaluates after global step ``step``."""
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    def after_step(self, step: int, meter: CommMeter) -> dict[str, Any]:
        """``{"eval": result}`` when step ``step`` is due, else ``{}``; what evaluating sent
        is taken off ``meter``, so the step's communication figures stay the step's."""
        if not self.due(step):
            return {}
        result = self.run()
        meter.take()
        return {"eval": result}

    def run(self, max_batches: int | None = None) -> dict[str, float]:
        """The loss and metrics over the whole set (every rank calls it at the same step)."""
        return evaluate_model(
            self.state.parallel,
            self.dataset,
            loss=self.spec.loss,
            metrics=dict(self.spec.metrics or {}),
            batch_size=self.batch_size,
            ctx=self.ctx,
            autocast=self.autocast,
            max_batches=max_batches,
            collate_fn=(self.spec.loader or {}).get("collate_fn"),
        )

    def check(self) -> None:
        """Evaluate the first batch only, before training: a metric that returns no scalar or
        a loss the data cannot give fails here, not after the first ``eval_every`` steps."""
        self.run(max_batches=1)
