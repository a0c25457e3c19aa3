"""DiLoCo's outer loop (Douillard et al., 2023): the inner optimizer steps on each rank's own
gradients; every ``inner_steps`` steps the outer gradient, the mean over the data-parallel
ranks of (global parameters - local parameters), is applied to the global parameters by an
outer SGD (Nesterov momentum by default), and every rank starts again from them.

The first outer step comes after the first inner step, then one every ``inner_steps`` (the
schedule of PyTorch's ``PeriodicModelAverager``, so ``LocalSGD(period=H)`` is the case
``outer_lr=1, outer_momentum=0``). The outer gradients travel as one flat tensor per dtype,
in bf16 with ``compress="bf16"``; with ``"int8"`` each rank's is quantized with one scale per
rank and gathered (``all_gather``), then averaged in fp32.

Example (``layouts.DDPLayout.build_optimizer``)::

    optimizer = DiLoCoOptimizer(torch.optim.AdamW(params, lr=1e-3), dp_group, DiLoCoConfig())
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from axon_nb.parallel.strategy_state import local_key
from axon_nb.spec.parallel_config import DiLoCoConfig


class DiLoCoOptimizer(torch.optim.Optimizer):
    """``optim`` for the inner steps, the outer step every ``config.inner_steps`` steps.
    Its ``state_dict`` holds the inner optimizer's, the global parameters, the outer momentum
    and the step count, so a checkpoint resumes the outer loop exactly."""

    def __init__(self, optim: torch.optim.Optimizer, group: Any, config: DiLoCoConfig) -> None:
        # (no Optimizer.__init__: param_groups and state are the inner optimizer's, as in
        # PyTorch's PostLocalSGDOptimizer)
        self.optim = optim
        self.param_groups = optim.param_groups
        self.state = optim.state  # (the inner optimizer's; bound again after a load)
        self.group = group
        self.config = config
        self.steps = 0
        self._params = [p for g in optim.param_groups for p in g["params"]]
        self.global_params = [p.detach().clone() for p in self._locals()]
        self.outer = torch.optim.SGD(
            self.global_params, lr=config.outer_lr, momentum=config.outer_momentum,
            nesterov=config.nesterov and config.outer_momentum > 0,
        )  # fmt: skip

    def _locals(self) -> list[torch.Tensor]:
        """What of each parameter this rank holds: a worker sharded by FSDP holds shards, and
        its outer loop works on them (each rank all-reduces its shard with the other
        workers' same shard). Taken anew each time: FSDP may replace a shard's tensor."""
        with torch.no_grad():
            return [_local(p) for p in self._params]

    def __repr__(self) -> str:
        return f"DiLoCo({self.config.inner_steps} inner steps of {self.optim!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        loss = self.optim.step(closure)
        if self.steps % self.config.inner_steps == 0:
            self.outer_step()
        self.steps += 1
        return loss

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the outer gradients over the ranks, step the outer optimizer, and set
        every rank's parameters to the new global ones."""
        deltas = [g - p.detach() for g, p in zip(self.global_params, self._locals(), strict=True)]
        for g, mean in zip(self.global_params, self._mean(deltas), strict=True):
            g.grad = mean
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for g, p in zip(self.global_params, self._locals(), strict=True):
            p.copy_(g)

    def _mean(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        if not deltas:
            return []
        flat = torch.cat([d.reshape(-1).float() for d in deltas])
        world = dist.get_world_size(self.group)
        if self.config.compress == "int8":
            flat = _int8_mean(flat, self.group, world)
        else:
            wire = flat.to(torch.bfloat16) if self.config.compress == "bf16" else flat
            dist.all_reduce(wire, group=self.group)
            flat = wire.float() / world
        out, at = [], 0
        for d in deltas:
            out.append(flat[at : at + d.numel()].view_as(d).to(d.dtype))
            at += d.numel()
        return out

    def state_dict(self) -> dict[str, Any]:
        state = self.optim.state_dict()
        state["diloco"] = {
            "steps": self.steps,
            "global": [g.detach().clone() for g in self.global_params],
            "outer": self.outer.state_dict(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        outer = state.pop("diloco", None)
        self.optim.load_state_dict(state)
        self.state = self.optim.state
        self.param_groups = self.optim.param_groups  # (torch makes new group dicts)
        if outer is None:  # (a checkpoint of another strategy: start the outer loop here)
            self.steps = 0
            for g, p in zip(self.global_params, self._locals(), strict=True):
                g.copy_(p.detach())
            return
        self.steps = int(outer["steps"])
        with torch.no_grad():
            for g, saved in zip(self.global_params, outer["global"], strict=True):
                g.copy_(saved)
        self.outer.load_state_dict(outer["outer"])

    @property
    def state_kind(self) -> str:
        """``diloco``, with the ranks per worker (their shards are kept per rank)."""
        return f"diloco(shard_size={self.config.shard_size})"

    def kept_tensors(self) -> list[torch.Tensor]:
        """What the outer loop holds besides the model and the inner optimizer (for the
        memory figures): the global parameters and the outer momentum."""
        momentum = [s["momentum_buffer"] for s in self.outer.state.values() if s]
        return [*self.global_params, *momentum]

    def strategy_state(
        self, names: dict[int, str], *, local: bool = True
    ) -> dict[str, torch.Tensor]:
        """The outer loop's state for a checkpoint (``strategy_state.py``): its step count,
        the global parameters and the outer momentum (zeros before the first outer step,
        which SGD's first momentum step treats as it treats none), and with ``local`` this
        rank's own parameters (``local<rank>/<name>``: they differ between outer steps, and a
        model checkpoint keeps one rank's)."""
        state = {"steps": torch.tensor([self.steps])}
        rank = dist.get_rank()
        for g, p, mine in zip(self.global_params, self._params, self._locals(), strict=True):
            momentum = self.outer.state.get(g, {}).get("momentum_buffer")
            momentum = momentum.detach() if momentum is not None else torch.zeros_like(g)
            state[f"global/{names[id(p)]}"] = _shaped_like(p, g.detach())
            state[f"momentum/{names[id(p)]}"] = _shaped_like(p, momentum)
            if local:
                state[local_key(rank, names[id(p)])] = mine.detach()
        return state

    @torch.no_grad()
    def load_strategy_state(self, saved: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        """Load what :meth:`strategy_state` gave; without this rank's own parameters (another
        number of ranks), every rank goes on from the global ones."""
        self.steps = int(saved["steps"].item())
        rank = dist.get_rank()
        for g, p, mine in zip(self.global_params, self._params, self._locals(), strict=True):
            g.copy_(_held(p, saved[f"global/{names[id(p)]}"]))
            mine.copy_(saved.get(local_key(rank, names[id(p)]), g))
            if self.config.outer_momentum > 0:
                momentum = _held(p, saved[f"momentum/{names[id(p)]}"])
                self.outer.state[g]["momentum_buffer"] = momentum.to(g).clone()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("DiLoCo keeps the parameter groups it was built with")


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of ``p`` this rank holds: its local shard when ``p`` is a DTensor (FSDP2), which
    shares its storage, else ``p``."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p  # (under no_grad: the tensor itself)


def _shaped_like(p: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``held`` (this rank's part of something shaped as ``p``) as a checkpoint stores it: a
    DTensor laid out as ``p`` when ``p`` is one, so that each shard is stored once."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return held
    return DTensor.from_local(held, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())  # fmt: skip


def _held(p: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``saved`` for parameter ``p``: its local shard of a DTensor, or of
    a whole tensor (a full checkpoint) laid out as ``p``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(saved, DTensor):
        return saved.to_local()
    if not isinstance(p, DTensor):
        return saved
    return distribute_tensor(saved.to(p.device), p.device_mesh, p.placements).to_local()


def _int8_mean(flat: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """The mean of every rank's ``flat``, sent as int8 with one fp32 scale per rank."""
    scale = flat.abs().max().clamp_min(1e-12) / 127.0
    quantized = torch.round(flat / scale).clamp_(-127, 127).to(torch.int8)
    pieces = [torch.empty_like(quantized) for _ in range(world)]
    scales = [torch.empty_like(scale.reshape(1)) for _ in range(world)]
    dist.all_gather(pieces, quantized, group=group)
    dist.all_gather(scales, scale.reshape(1), group=group)
    total = sum(q.float() * s for q, s in zip(pieces, scales, strict=True))
    return torch.as_tensor(total) / world
