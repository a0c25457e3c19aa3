"""Pipelines of a transformers model, which is no ``nn.Sequential``: cut by its own pipeline
plan (``base_model_pp_plan``) or by ``Pipeline(split=...)``, with dict batches and the model's
own loss, under every schedule and in hybrid layouts; each run equals ``train_local``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_models import FixedTokens, tiny_llama

import axon_nb
from axon_nb import Hybrid, Pipeline

pytest.importorskip("transformers")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

STEPS = 12
RUN: dict[str, Any] = dict(
    model=tiny_llama, data=FixedTokens(), steps=STEPS, batch_size=8,
    optimizer=("adamw", {"lr": 1e-2}),
)  # fmt: skip
NAMES = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return axon_nb.train_local(**RUN).losses


def assert_same_losses(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst < rel, (worst, got, want)


@pytest.mark.parametrize(
    "strategy",
    [
        Pipeline(microbatches=2, schedule="gpipe"),
        Pipeline(microbatches=2, schedule="1f1b"),
        Pipeline(microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
        Pipeline(microbatches=2, split=NAMES, split_points=(3,)),
    ],
    ids=["gpipe", "1f1b", "interleaved", "split"],
)
def test_a_llama_pipelines_by_its_plan_as_in_one_process(
    pooled_cluster_2: axon_nb.Cluster, reference: list[float], strategy: Pipeline
) -> None:
    result = pooled_cluster_2.train(**RUN, strategy=strategy)
    assert_same_losses(result.losses, reference)


@pytest.mark.parametrize(
    "strategy",
    [Hybrid(dp=2, pp=2, microbatches=2), Hybrid(tp=2, pp=2, microbatches=2, plan="auto")],
    ids=["dp2-pp2", "tp2-pp2"],
)
def test_a_llama_in_hybrid_layouts_as_in_one_process(
    pooled_cluster_4: axon_nb.Cluster, reference: list[float], strategy: Hybrid
) -> None:
    result = pooled_cluster_4.train(**RUN, strategy=strategy)
    assert_same_losses(result.losses, reference)


class _NoPlan(torch.nn.Module):
    """A model a pipeline cannot cut by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _left_padded() -> list[dict[str, torch.Tensor]]:
    ids = torch.arange(1, 13)
    mask = torch.ones(12, dtype=torch.long)
    mask[:2] = 0
    return [{"input_ids": ids, "labels": ids, "attention_mask": mask}] * 16


def _ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def test_models_and_batches_a_pipeline_cannot_take_say_what_to_do(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    pairs = [(torch.arange(12), torch.arange(12))] * 16
    cases = [
        (dict(model=_NoPlan, data=pairs, loss=_ce), "split=.*pipeline_layers"),
        (dict(strategy=Pipeline(split=("model.embed", "lm_head"))), "nearest.*embed_tokens"),
        (dict(data=_left_padded), "padding_side = 'right'"),
    ]
    for bad, match in cases:
        args = {"strategy": Pipeline(microbatches=2), **RUN, **bad, "steps": 1}
        with pytest.raises(axon_nb.RankError, match=match):
            pooled_cluster_2.train(**args)
    with pytest.raises(ValueError, match="split must be a tuple of module names"):
        Pipeline(split="model.layers")  # type: ignore[arg-type]
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]
