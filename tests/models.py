"""Small models and datasets for training tests; importable on the ranks (PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_mlp() -> nn.Module:
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def make_data(n: int = 512) -> TensorDataset:
    """A fixed regression problem: the same samples on every rank."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=g))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def failing_on_rank(rank: int):
    """A model factory that raises on ``rank`` only."""

    def make() -> nn.Module:
        import torch.distributed as dist

        if dist.get_rank() == rank:
            raise RuntimeError(f"factory broke on rank {rank}")
        return make_mlp()

    return make


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def mse_failing_at(step: int, rank: int):
    """``mse``, except that the ``step``-th call on ``rank`` raises (a failure mid-run)."""
    calls = {"n": 0}

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        calls["n"] += 1
        if dist.get_rank() == rank and calls["n"] == step:
            raise FloatingPointError(f"loss diverged on rank {rank}")
        return mse(output, target)

    return loss


def mse_holding_iopub_at(step: int, seconds: float):
    """``mse``, except that the ``step``-th call holds the engine's IOPub thread for ``seconds``
    and lets the engine's reply go without waiting for it: what the rank publishes from then
    on reaches the kernel after its result, as it does on a loaded machine, where the
    controller relays the two on separate threads."""
    calls = {"n": 0}

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import sys
        import time

        from IPython import get_ipython

        calls["n"] += 1
        if calls["n"] == step:
            # ipykernel's streams wait up to ``flush_timeout`` for the IOPub thread before the
            # reply is sent; waiting less lets the reply overtake the held publications.
            waited = sys.stdout.flush_timeout
            sys.stdout.flush_timeout = sys.stderr.flush_timeout = 0.1

            def hold() -> None:
                time.sleep(seconds)
                sys.stdout.flush_timeout = sys.stderr.flush_timeout = waited

            get_ipython().kernel.iopub_socket.schedule(hold)
        return mse(output, target)

    return loss


class Stream(torch.utils.data.IterableDataset):
    """``n`` regression pairs read as a stream (the same items each time it is read)."""

    def __init__(self, n: int = 512) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(99)
        w = torch.randn(8, 4, generator=g)
        for _ in range(self.n):
            x = torch.randn(8, generator=g)
            yield x, torch.tanh(x @ w)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time (a sleep, which
    needs no CPU: ranks sharing cores with other work keep their timing)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepingLayer(nn.Module):
    """A linear layer whose forward takes ``forward_s`` and backward ``backward_s`` seconds."""

    def __init__(self, width_in: int, width_out: int, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), self.forward_s, self.backward_s)


def sleeping_stages(n: int = 4, forward_s: float = 0.02, backward_s: float = 0.04) -> nn.Module:
    """``n`` sleeping layers in a Sequential (8 features in, 4 out, for ``make_data``): a
    pipeline whose stage times are set by the clock, not by how busy the cores are."""
    torch.manual_seed(0)
    widths = [8] * n + [4]
    return nn.Sequential(
        *(SleepingLayer(widths[i], widths[i + 1], forward_s, backward_s) for i in range(n))
    )


def slow_mse(seconds: float, say_at: int | None = None, text: str = "", after: int = 0):
    """``mse`` that takes ``seconds`` more per call after its ``after``-th (a long run on a
    fast model), and prints ``text`` on its ``say_at``-th call (what a rank says mid-run)."""
    calls = {"n": 0}

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == say_at:
            print(text, flush=True)
        if calls["n"] > after:
            time.sleep(seconds)
        return mse(output, target)

    return loss


def _arrived(value: Any, seconds: float) -> Any:
    time.sleep(seconds)
    return value


class ArrivesSlowly:
    """``fn`` whose unpickling, on the ranks, takes ``seconds``: the run is longer in transit
    (it is unpickled before it begins)."""

    def __init__(self, fn: Any, seconds: float) -> None:
        self.fn, self.seconds = fn, seconds

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (self.fn, self.seconds))


def mse_slow_until(deadline: float, seconds: float):
    """``mse`` that sleeps ``seconds`` per call until ``time.time()`` passes ``deadline`` (a
    run that must outlast a notice, then a resumed one that need not be slow)."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if time.time() < deadline:
            time.sleep(seconds)
        return mse(output, target)

    return loss
