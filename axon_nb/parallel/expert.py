"""Expert parallelism: each of ``ep`` ranks keeps ``E / ep`` experts and tokens travel to them.

``apply_ep`` turns every experts module a plan names (``axon_nb.parallel.expert_plan``) into
this rank's share of it: its ``[E, ...]`` parameters become DTensors sharded on dimension 0
over the ``ep`` axis (rank ``i`` keeps experts ``i*E/ep ... (i+1)*E/ep - 1``, so
checkpoints and state dicts see the whole ``[E, ...]`` tensors), and its forward dispatches::

    1. sort this rank's (token, expert) assignments by expert
    2. all_to_all_single the per-expert counts, then the tokens (uneven splits)
    3. run the local experts (the module's own forward on its local weights, one expert each)
    4. all_to_all_single the results back, weight them and add them up per token

Both all-to-alls are differentiable (``torch.distributed.nn.functional``), so backward sends
each token's gradient back to the rank that routed it. Routing is dropless, so the result
equals the module's forward in one process.

Gradients: the non-expert parameters are averaged over all ``dp`` ranks by DDP or FSDP, which
ignore the experts. An expert's gradient already sums the contributions of every token its
``ep`` group routed to it; ``reduce_expert_grads`` adds those of the other expert replicas
(the ``edp`` axis) and divides by ``dp``, the same mean as the others get.

Example::

    experts = apply_ep(model, mesh["ep"], plan=None)
    ...backward...
    reduce_expert_grads(experts, mesh_edp_group, data_ranks=4)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from axon_nb.models.moe import by_expert, combine
from axon_nb.parallel.expert_plan import expert_modules

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# PyTorch 2.13 deprecates this module's all_to_all_single for the functional collectives',
# whose backward runs in C++, out of the communication meter's sight (it measures the
# Python calls): kept, without the warning on every rank.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated"
)


class ExpertDispatch(nn.Module):
    """Put in front of an experts module's class by :func:`apply_ep`: its forward dispatches
    tokens to the ranks that keep their experts and runs the original forward on the local
    ones."""

    ep_group: Any
    num_experts: int
    routed: torch.Tensor | None
    """Tokens routed to each expert since ``take_routed_tokens`` last read them."""

    def forward(
        self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # (the per-expert counts go first: 8 bytes per expert, then the tokens, then back)
        group, local = self.ep_group, self.num_experts
        ep = dist.get_world_size(group)
        order, token, counts = by_expert(top_k_index, local * ep)
        if self.training:  # the load the dashboard shows (summed until report reads it)
            routed = getattr(self, "routed", None)
            self.routed = counts.detach() if routed is None else routed + counts.detach()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert]
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.view(ep, local).sum(1).tolist()
        inbound = dist_fn.all_to_all_single(
            tokens.new_empty(sum(recv), tokens.shape[1]), tokens[token], recv, send, group=group
        )
        expert = torch.arange(local, device=counts.device).repeat(ep)
        expert = expert.repeat_interleave(received.to(counts.device))
        with _local_weights(self):
            outbound = super().forward(
                inbound, expert[:, None], torch.ones_like(expert, dtype=tokens.dtype)[:, None]
            )
        back = dist_fn.all_to_all_single(
            tokens.new_empty(len(token), tokens.shape[1]), outbound, send, recv, group=group
        )
        return combine(tokens, back, top_k_weights, order, token)


def apply_ep(model: nn.Module, ep_mesh: Any, plan: Sequence[str] | None) -> list[nn.Module]:
    """Shard the experts of every module ``plan`` names over ``ep_mesh`` (1-D) and make them
    dispatch their tokens; returns those modules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    found = expert_modules(model, plan, ep)
    for module in found.values():
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            module.register_parameter(
                name, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )
        module.num_experts //= ep
        module.ep_group = ep_mesh.get_group()
        module.__class__ = _dispatching(type(module))
    return list(found.values())


def take_routed_tokens(model: nn.Module) -> list[int] | None:
    """Tokens this rank routed to each expert (global index) since the last call, summed
    over the MoE layers; None without dispatching experts. Resets the counts."""
    total: torch.Tensor | None = None
    for module in model.modules():
        routed = getattr(module, "routed", None) if isinstance(module, ExpertDispatch) else None
        if isinstance(module, ExpertDispatch) and routed is not None:
            total = routed if total is None else total + routed
            module.routed = None
    return None if total is None else [int(n) for n in total.tolist()]


def reduce_expert_grads(params: Sequence[torch.Tensor], edp_group: Any, data_ranks: int) -> None:
    """Sum the expert gradients over their replicas (``edp_group``, None for none) and divide
    by ``data_ranks``: the mean over every rank's data that the other parameters get."""
    for p in params:
        if p.grad is None and p.requires_grad:  # local experts no token reached this step
            p.grad = torch.zeros_like(p)  # (as in one process: the stacked weight has one)
    grads = [cast("DTensor", p.grad).to_local() for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if edp_group is not None and dist.get_world_size(edp_group) > 1:
        dist.all_reduce(flat, group=edp_group)
    flat /= data_ranks
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


_CLASSES: dict[type, type] = {}


def _dispatching(cls: type) -> type:
    """``cls`` with :class:`ExpertDispatch` in front (one class per original, as FSDP does)."""
    if issubclass(cls, ExpertDispatch):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertDispatch, cls), {})
    return _CLASSES[cls]


@contextlib.contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters read as their local shards (differentiably) while its
    own forward runs: it indexes ``weight[e]`` for its local experts ``e``."""
    from torch.distributed.tensor import DTensor

    saved = dict(module._parameters)
    for name, param in saved.items():
        if isinstance(param, DTensor):
            module._parameters[name] = param.to_local()
    try:
        yield
    finally:
        module._parameters.update(saved)
