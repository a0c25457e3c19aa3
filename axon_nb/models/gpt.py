"""A small GPT-style transformer: the reference model for the parallelism strategies.

Attention keeps separate q/k/v projections and an output projection, and the MLP an up and a
down projection, so tensor-parallel plans can name them (column: q, k, v, up; row: out, down).
Blocks live in ``model.blocks`` (an ``nn.ModuleList``) for auto-wrapping and pipeline cuts.
With ``GPTConfig(experts=E, top_k=k)`` each block's MLP is a mixture of experts
(``axon_nb.models.moe``), which ``ExpertParallel`` splits over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from axon_nb.models.moe import MoE


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Sizes of a :class:`GPT`."""

    vocab_size: int = 64
    """Number of token ids."""
    block_size: int = 32
    """Longest sequence (positions)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 2
    """Attention heads per block."""
    n_embd: int = 32
    """Hidden size (divisible by ``n_head``)."""
    experts: int = 0
    """Experts per block's MLP (``axon_nb.models.moe``); 0: a dense MLP."""
    top_k: int = 2
    """With ``experts``: experts each token is routed to."""
    aux_loss_coef: float = 0.0
    """With ``experts``: weight of the load-balancing loss added to ``model(idx, targets)``."""


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (p(x).view(b, t, -1, x.shape[-1] // self.n_head).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp: nn.Module = (
            MoE(config.n_embd, config.experts, config.top_k) if config.experts else MLP(config)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``model(idx)`` gives logits; ``model(idx, targets)`` the loss.

    Example::

        model = GPT(GPTConfig(n_layer=4))
        loss = model(idx, targets)
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = _embed(self.tok_emb, self.pos_emb, idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = lm_loss(logits, targets)
        if self.config.experts and self.config.aux_loss_coef:
            # (by module, not block: activation checkpointing may have wrapped the blocks)
            moes = [m for m in self.modules() if isinstance(m, MoE)]
            aux = sum(m.aux_loss for m in moes if m.aux_loss is not None)
            loss = loss + self.config.aux_loss_coef * aux / len(self.blocks)
        return loss

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers in forward order, for pipeline cuts: embedding, each block,
        head. They share this model's modules (and so its parameters and their names)."""
        return [Embedding(self.tok_emb, self.pos_emb), *self.blocks, Head(self.ln_f, self.head)]


class Embedding(nn.Module):
    """Token plus position embedding: a GPT's first pipeline layer."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self.tok_emb, self.pos_emb, idx)


class Head(nn.Module):
    """Final norm and output projection to logits: a GPT's last pipeline layer."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``logits`` (batch, time, vocab) against ``targets``.

    Example::

        cluster.train(model=GPT, data=token_dataset, loss=lm_loss, strategy=Pipeline(), ...)
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _embed(tok_emb: nn.Embedding, pos_emb: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(idx.shape[1], device=idx.device)
    return tok_emb(idx) + pos_emb(positions)


def token_dataset(
    n: int = 512, *, block_size: int = 32, vocab_size: int = 64, seed: int = 0
) -> TensorDataset:
    """Next-token pairs ``(x, y)`` cut from a learnable sequence (a noisy arithmetic walk)."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 4, (n * block_size + 1,), generator=g)
    tokens = torch.cumsum(steps, 0) % vocab_size
    x = torch.stack([tokens[i * block_size : (i + 1) * block_size] for i in range(n)])
    y = torch.stack([tokens[i * block_size + 1 : (i + 1) * block_size + 1] for i in range(n)])
    return TensorDataset(x, y)
