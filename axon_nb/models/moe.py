"""Mixture of experts for the reference GPT: a top-k router and experts with grouped weights.

``MoE`` replaces a block's MLP when ``GPTConfig(experts=E, top_k=k)``. The router is a linear
layer scoring every expert per token; each token goes to its ``k`` best experts with weights
that are the softmax of those scores renormalised over the chosen ``k``. Routing is dropless
(no capacity limit), so a token's output never depends on which other tokens share its batch
or rank, and a run split over ranks equals the run in one process.

``GroupedExperts`` holds every expert in one parameter per projection, shape ``[E, ...]``
(as torchtitan and transformers do), and takes ``(tokens, top_k_index, top_k_weights)``:
transformers' ``MixtralExperts`` call. Expert parallelism (``axon_nb.parallel.expert``) keeps
``E / ep`` experts per rank by slicing the first dimension and dispatches tokens to them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer GELU MLPs, ``dim -> hidden -> dim``, as two stacked weights.

    Example::

        experts = GroupedExperts(num_experts=4, dim=32, hidden=128)
        y = experts(tokens, top_k_index, top_k_weights)   # (N, 32), (N, k), (N, k) -> (N, 32)
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default init, per expert
        for weight in (self.up_proj, self.down_proj):
            bound = 1.0 / weight.shape[1] ** 0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        order, token, counts = by_expert(top_k_index, self.num_experts)
        chunks = tokens[token].split(counts.tolist())
        outputs = [
            F.gelu(chunk @ self.up_proj[e]) @ self.down_proj[e] for e, chunk in enumerate(chunks)
        ]
        return combine(tokens, torch.cat(outputs), top_k_weights, order, token)


def by_expert(
    top_k_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) assignments of ``top_k_index`` (tokens, k) grouped by expert:
    ``order`` (a stable sort of the flattened assignments), ``token`` (each sorted
    assignment's token) and ``counts`` (assignments per expert)."""
    flat = top_k_index.flatten()
    order = torch.argsort(flat, stable=True)
    return order, order // top_k_index.shape[1], torch.bincount(flat, minlength=num_experts)


def combine(
    tokens: torch.Tensor,
    outputs: torch.Tensor,
    top_k_weights: torch.Tensor,
    order: torch.Tensor,
    token: torch.Tensor,
) -> torch.Tensor:
    """Each token's output: its experts' ``outputs`` (in :func:`by_expert`'s order) weighted
    by ``top_k_weights`` and added up, in ``tokens``' shape and dtype."""
    weighted = outputs * top_k_weights.flatten()[order, None].to(outputs.dtype)
    return torch.zeros_like(tokens).index_add_(0, token, weighted.to(tokens.dtype))


class MoE(nn.Module):
    """Router plus experts: a block's MLP in a mixture-of-experts GPT.

    After each forward, ``aux_loss`` holds the load-balancing loss of that call (Switch
    Transformer's: ``E * sum_e fraction_of_assignments_e * mean_router_probability_e``, 1.0 when
    perfectly balanced); :class:`~axon_nb.models.gpt.GPT` adds ``aux_loss_coef`` times it to
    the loss it computes.

    Example::

        moe = MoE(dim=32, num_experts=4, top_k=2)
        y = moe(x)   # (batch, time, 32) -> (batch, time, 32)
    """

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and experts={num_experts}, got {top_k}")
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, 4 * dim)
        self.aux_loss: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, object]:
        # The last call's loss is part of that call's graph: copies and pickles go without it.
        return {**super().__getstate__(), "aux_loss": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.aux_loss = balance_loss(probs, index)
        return self.experts(tokens, index, weights).reshape(x.shape)


def balance_loss(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one routing: ``probs`` (tokens, E) and the
    chosen ``index`` (tokens, k). 1.0 when every expert gets the same share."""
    num_experts = probs.shape[1]
    share = torch.bincount(index.flatten(), minlength=num_experts).float() / index.numel()
    return num_experts * (share * probs.mean(dim=0)).sum()
