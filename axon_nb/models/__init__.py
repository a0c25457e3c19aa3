"""Reference models for examples, tests and benchmarks."""

from axon_nb.models.gpt import GPT, Block, GPTConfig, lm_loss, token_dataset

__all__ = ["GPT", "Block", "GPTConfig", "lm_loss", "token_dataset"]
