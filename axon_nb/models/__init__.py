"""Reference models for examples, tests and benchmarks."""

from axon_nb.models.gpt import GPT, Block, GPTConfig, lm_loss, token_dataset
from axon_nb.models.moe import GroupedExperts, MoE

__all__ = ["GPT", "Block", "GPTConfig", "GroupedExperts", "MoE", "lm_loss", "token_dataset"]
