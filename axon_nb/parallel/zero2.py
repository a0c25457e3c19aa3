"""ZeRO stage 2: whole parameters on every rank; gradients and optimizer state sharded.

PyTorch has no ZeRO-2 (FSDP's ``shard_grad_op`` also shards parameters between steps), so it
is built here from ``torch.distributed`` collectives:

- Parameters are packed into flat buckets of about ``bucket_cap_mb``, in reverse registration
  order (roughly the order backward produces gradients), and each parameter becomes a view
  into its bucket. A model smaller than ``MIN_BUCKETS`` buckets gets smaller ones (a quarter of
  its trainable bytes each, a parameter never split), so its gradients never all exist at
  once. A module's own parameters (a linear's weight and bias) share a bucket, whatever the
  cap: backward makes their gradients together. A bucket is padded to a multiple of the
  world size; rank r owns the r-th contiguous slice of every bucket.
- In backward each gradient, as autograd makes it, is copied into its bucket's flat gradient
  buffer (made when the bucket's first gradient arrives) and dropped. When every parameter of
  a bucket has its gradient the buffer is reduce-scattered (asynchronously): rank r receives
  the sum over ranks of its slice. Before the next buffer is made, the reduce-scatter in
  flight is waited for and its buffer freed, so when gradients arrive bucket by bucket (the
  reverse registration order, as backward mostly produces them) backward holds one bucket of
  whole gradients (and the one gradient being copied) besides this rank's slices: the ZeRO
  paper's parameters + gradients/N + optimizer state/N, plus a bucket. A bucket still
  waiting for a gradient that comes later (a parameter used again earlier in the forward)
  keeps its buffer beside the next one.
- The optimizer sees one parameter per bucket: this rank's slice, a view into the bucket (so
  updating it updates the model's parameters in place), with the averaged gradient shard as
  its ``.grad``. After each optimizer step every bucket is all-gathered from the slices.

Like DDP without ``find_unused_parameters``, every rank must use the same parameters in a step.
Optimizers must act elementwise (SGD, Adam, AdamW, ...): a bucket slice mixes parameters. A
bucket holds parameters of one optimizer parameter group only, so each group keeps its own
settings (``train(param_groups=...)``); frozen parameters are in no bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon_nb.metrics.peak import attributed
from axon_nb.parallel.optim_state import by_index, settings
from axon_nb.parallel.param_groups import check_built

MIN_BUCKETS = 4
"""A model is split into at least this many buckets (where its parameters allow)."""


class _Bucket:
    """Flat storage for some parameters, and this rank's slice of it."""

    def __init__(
        self, params: list[nn.Parameter], rank: int, world_size: int, group: int = 0
    ) -> None:
        numel = sum(p.numel() for p in params)
        self.size = -(-numel // world_size) * world_size
        first = params[0]
        self.flat = torch.zeros(self.size, dtype=first.dtype, device=first.device)
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            self.offsets.append(offset)
            offset += p.numel()
        self.params = params
        self.grads: torch.Tensor | None = None
        """The flat gradients being gathered for the reduce-scatter, during backward."""
        width = self.size // world_size
        self.slice = slice(rank * width, (rank + 1) * width)
        self.shard = nn.Parameter(self.flat[self.slice])  # shares the bucket's storage
        self.arrived: set[int] = set()
        """Positions of the parameters whose gradients are in ``grads`` this step."""
        self.group = group
        """The optimizer parameter group of its parameters."""


class GradShardedModel(nn.Module):
    """The user's module (``.module``) with ZeRO-2 gradient sharding attached.

    Example (what ``ZeRO(stage=2)`` does on each rank)::

        model = GradShardedModel(net, group, bucket_cap_mb=25)
        optimizer = model.build_optimizer(OptimizerFactory(torch.optim.AdamW, {"lr": 1e-3}))
    """

    def __init__(
        self,
        module: nn.Module,
        group: Any,
        *,
        bucket_cap_mb: float = 25.0,
        param_groups: list[list[nn.Parameter]] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.group = group
        """The data-parallel ranks the gradients and optimizer state are sharded over."""
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if param_groups is None:
            param_groups = [[p for p in module.parameters() if p.requires_grad]]
        cap = bucket_cap(param_groups, bucket_cap_mb)
        owners = {id(p): id(m) for m in module.modules() for p in m.parameters(recurse=False)}
        self.buckets = [
            bucket
            for index, params in enumerate(param_groups)
            for bucket in _pack(params, rank, self.world_size, cap, index, owners)
        ]
        self.require_sync = True
        self._pending: list[tuple[Any, torch.Tensor, _Bucket, torch.Tensor]] = []
        self._reduced: set[int] = set()
        for index, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(index, position))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def build_optimizer(
        self, factory: Any, options: Sequence[dict[str, Any]] = ({},)
    ) -> torch.optim.Optimizer:
        """The optimizer over this rank's slices, one parameter group per group of parameters
        (``options``: each group's settings), built by ``factory`` (a named optimizer or the
        user's callable); each step ends in an all-gather."""
        groups = [
            {"params": [b.shard for b in self.buckets if b.group == index], **settings}
            for index, settings in enumerate(options)
        ]
        optimizer = factory(groups)
        if factory.cls is None:
            check_built(optimizer, groups, keep_groups=True)
        optimizer.register_step_post_hook(lambda *_: self.gather())
        return optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduce-scatter) inside this context."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def _hook(self, index: int, position: int) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            if not self.require_sync:
                return
            bucket = self.buckets[index]
            if bucket.grads is None:
                self._drain()  # the reduce-scatter in flight ends before another buffer exists
                with attributed("buckets"):
                    bucket.grads = param.new_zeros(bucket.size)
            offset = bucket.offsets[position]
            assert param.grad is not None
            # added, not copied: a parameter whose gradient comes twice before its bucket is
            # reduced (two backwards) keeps both
            bucket.grads[offset : offset + param.numel()].add_(param.grad.reshape(-1))
            param.grad = None  # the whole gradient goes; its sum is in the bucket's buffer
            bucket.arrived.add(position)
            if len(bucket.arrived) == len(bucket.params):
                self._reduce(index)

        return on_grad

    def _reduce(self, index: int) -> None:
        bucket = self.buckets[index]
        flat = bucket.grads if bucket.grads is not None else bucket.flat.new_zeros(bucket.size)
        bucket.grads = None
        bucket.arrived.clear()
        self._reduced.add(index)
        # gradients the hooks did not take: accumulated under no_sync by a parameter the last
        # micro-batch did not use
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        out = torch.empty_like(bucket.shard)
        work = _reduce_scatter()(out, flat, group=self.group, async_op=True)
        self._pending.append((work, out, bucket, flat))

    def _drain(self) -> None:
        """Wait for the reduce-scatters in flight, add their results to the slices' ``.grad``
        and free their buffers."""
        for work, out, bucket, _ in self._pending:
            work.wait()
            out.div_(self.world_size)
            shard = bucket.shard
            shard.grad = out if shard.grad is None else shard.grad.add_(out)
        self._pending.clear()

    def finish_backward(self) -> None:
        """Reduce what the hooks did not (buckets some of whose parameters got no gradient)
        and wait for every reduce-scatter; afterwards each bucket's ``shard.grad`` holds the
        averaged gradient."""
        for index in range(len(self.buckets)):
            if index not in self._reduced:
                self._drain()
                self._reduce(index)
        self._drain()
        self._reduced.clear()

    def gather(self) -> None:
        """Bring every rank's updated slice into every rank's buckets."""
        for bucket in self.buckets:
            _all_gather()(bucket.flat, bucket.shard.detach().clone(), group=self.group)

    def shards(self) -> list[nn.Parameter]:
        """This rank's slices, one per bucket: what its optimizer steps."""
        return [b.shard for b in self.buckets]

    def full_optimizer_state(
        self, optimizer: torch.optim.Optimizer, names: dict[int, str]
    ) -> dict[str, Any]:
        """The optimizer state per parameter name (as for an unsharded model), on every rank;
        ``names`` maps ``id(parameter)`` to its name."""
        state: dict[str, dict[str, Any]] = {}
        for bucket in self.buckets:
            for key, value in optimizer.state.get(bucket.shard, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == bucket.shard.shape:
                    full = value.new_empty(bucket.size)
                    _all_gather()(full, value.contiguous(), group=self.group)
                    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                        piece = full[offset : offset + p.numel()].view_as(p).clone()
                        state.setdefault(names[id(p)], {})[key] = piece
                else:  # step counters and other per-tensor scalars
                    for p in bucket.params:
                        state.setdefault(names[id(p)], {})[key] = _copy(value)
        groups = [
            {**settings(group), "params": self._group_names(index, names)}
            for index, group in enumerate(optimizer.param_groups)
        ]
        return {"state": state, "param_groups": groups}

    def _group_names(self, index: int, names: dict[int, str]) -> list[str]:
        return [names[id(p)] for b in self.buckets if b.group == index for p in b.params]

    def load_full_optimizer_state(
        self, optimizer: torch.optim.Optimizer, full: dict[str, Any], names: dict[int, str]
    ) -> None:
        """Load a state made by ``full_optimizer_state`` (from any world size)."""
        local: dict[int, dict[str, Any]] = {}
        for index, bucket in enumerate(self.buckets):
            per_param = [full["state"].get(names[id(p)], {}) for p in bucket.params]
            for key, value in per_param[0].items():
                if isinstance(value, torch.Tensor) and value.shape == bucket.params[0].shape:
                    flat = torch.zeros(bucket.size, dtype=value.dtype)
                    for p, offset, entry in zip(
                        bucket.params, bucket.offsets, per_param, strict=True
                    ):
                        flat[offset : offset + p.numel()] = entry[key].reshape(-1).cpu()
                    local.setdefault(index, {})[key] = flat[bucket.slice].clone()
                else:
                    local.setdefault(index, {})[key] = _copy(value)
        groups = [self._group_names(i, names) for i in range(len(optimizer.param_groups))]
        saved = by_index(full, groups)["param_groups"]  # (checks they hold the same parameters)
        # buckets are made group after group: bucket i is the optimizer's i-th parameter
        owned = [[i for i, b in enumerate(self.buckets) if b.group == g] for g in range(len(saved))]
        optimizer.load_state_dict(
            {
                "state": local,
                "param_groups": [
                    {**settings(group), "params": params}
                    for group, params in zip(saved, owned, strict=True)
                ],
            }
        )


def bucket_cap(param_groups: list[list[nn.Parameter]], bucket_cap_mb: float) -> int:
    """Bytes a bucket may hold: ``bucket_cap_mb``, or for a smaller model a
    ``MIN_BUCKETS``-th of its trainable bytes."""
    total = sum(p.numel() * p.element_size() for params in param_groups for p in params)
    return max(1, min(int(bucket_cap_mb * 2**20), total // MIN_BUCKETS))


def _pack(
    params: list[nn.Parameter],
    rank: int,
    world_size: int,
    cap_bytes: int,
    group: int,
    owners: dict[int, int],
) -> list[_Bucket]:
    """Buckets of ``params`` (one optimizer group's trainable parameters), last registered
    first, one dtype and device each, a module's own parameters (``owners``: a parameter's id
    to its module's) in one bucket."""
    runs: list[list[nn.Parameter]] = []  # a module's parameters, in order
    for p in reversed(params):
        if runs and owners.get(id(p), id(p)) == owners.get(id(runs[-1][-1])):
            runs[-1].append(p)
        else:
            runs.append([p])
    buckets: list[_Bucket] = []
    members: list[nn.Parameter] = []
    size = 0
    for run in runs:
        for p in run:  # one kind per bucket, even within a module
            same_kind = not members or (p.dtype, p.device) == (members[0].dtype, members[0].device)
            full = p is run[0] and size + _bytes(run) > cap_bytes
            if members and (full or not same_kind):
                buckets.append(_Bucket(members, rank, world_size, group))
                members, size = [], 0
            members.append(p)
            size += p.numel() * p.element_size()
    if members:
        buckets.append(_Bucket(members, rank, world_size, group))
    return buckets


def _bytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _reduce_scatter() -> Any:
    """``dist.reduce_scatter_single`` (PyTorch 2.13's name, looked up at each call: the
    communication probe wraps it), or ``reduce_scatter_tensor`` in releases without it."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather() -> Any:
    """``dist.all_gather_single``, or ``all_gather_into_tensor`` before PyTorch 2.13."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
