"""``cluster.generate`` with a transformers causal LM the ranks hold: greedy tokens equal the
single-process model's ``generate`` on the same weights under DDP, FSDP and tensor
parallelism; sampling is reproducible with a seed; bad input is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_models import FixedTokens, lora_llama, tiny_llama

import axon_nb
from axon_nb import DDP, FSDP, TensorParallel
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROMPTS = torch.tensor([[5, 9, 14, 3], [7, 7, 2, 11]])


def _full_model(name: str = "model") -> dict[str, torch.Tensor]:
    from axon_nb.rank.training import trainstate

    return trainstate.get(name).parallel.full_state_dict()


def _one_process(cluster: axon_nb.Cluster, make: Any = tiny_llama, **options: Any) -> torch.Tensor:
    model = make()
    model.load_state_dict(cluster.run(_full_model, stream=False)[0])
    model.eval()
    with torch.no_grad():
        return model.generate(input_ids=PROMPTS, max_new_tokens=8, **options)


@pytest.mark.parametrize("strategy", [DDP(), FSDP(), TensorParallel(plan="auto")], ids=str)
def test_greedy_tokens_equal_one_process(pooled_cluster_2: axon_nb.Cluster, strategy: Any) -> None:
    pooled_cluster_2.train(tiny_llama, FixedTokens(), strategy=strategy, steps=3, batch_size=8)
    got = pooled_cluster_2.generate(PROMPTS, max_new_tokens=8, do_sample=False)
    want = _one_process(pooled_cluster_2, do_sample=False)
    assert got.shape == (2, 12)
    assert torch.equal(got, want)
    # the ranks trained on: generating changed nothing a resumed run depends on
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_a_lora_adapter_under_fsdp_generates_as_in_one_process(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """A PEFT model's generate calls its base model's, never its own forward: FSDP must
    still gather the root's parameters (the embedding) around it."""
    pooled_cluster_2.train(lora_llama, FixedTokens(), strategy=FSDP(), steps=3, batch_size=8)
    got = pooled_cluster_2.generate(PROMPTS, max_new_tokens=8)
    assert torch.equal(got, _one_process(pooled_cluster_2, lora_llama, do_sample=False))


def test_sampling_is_reproducible_with_a_seed(pooled_cluster_2: axon_nb.Cluster) -> None:
    pooled_cluster_2.train(tiny_llama, FixedTokens(), strategy=FSDP(), steps=2, batch_size=8)
    sample = dict(max_new_tokens=8, do_sample=True, top_k=20)
    first = pooled_cluster_2.generate(PROMPTS, seed=3, **sample)
    assert torch.equal(first, pooled_cluster_2.generate(PROMPTS, seed=3, **sample))
    others = [pooled_cluster_2.generate(PROMPTS, seed=s, **sample) for s in (4, 5)]
    assert any(not torch.equal(first, o) for o in others)


def test_a_model_without_generate_and_bad_arguments_are_refused(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    data = token_dataset(64, block_size=16, vocab_size=64)
    pooled_cluster_2.train(
        lambda: GPT(config), data, loss=lm_loss, steps=1, batch_size=8, name="gpt"
    )
    with pytest.raises(axon_nb.RankError, match="has no generate"):
        pooled_cluster_2.generate(PROMPTS, max_new_tokens=4, name="gpt")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        pooled_cluster_2.generate(PROMPTS, max_new_tokens=0, name="gpt")
    with pytest.raises(ValueError, match="input_ids is required"):
        pooled_cluster_2.generate([], max_new_tokens=4, name="gpt")
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]  # the ranks are fine
