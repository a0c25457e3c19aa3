"""Ways a rank can be busy when its cluster is stopped (imported by the ranks from tests/)."""

from __future__ import annotations

import time


def sleep_in_cell(seconds: float = 600) -> None:
    time.sleep(seconds)


def stuck_in_collective() -> None:
    """Rank 0 waits in an all-reduce that the others never join."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def hold_the_gil_in_c(seconds: int = 600) -> None:
    """libc's sleep called through ctypes.PyDLL, which keeps the GIL: no Python signal
    handler runs until it returns."""
    import ctypes

    ctypes.PyDLL(None).sleep(seconds)


def train_forever(cluster):  # type: ignore[no-untyped-def]
    """A ``block=False`` run far longer than any test (kernel side)."""
    from models import make_data, make_mlp, mse

    return cluster.train(make_mlp, make_data(), loss=mse, steps=10**6, batch_size=8, block=False)


MODES = {
    "sleep": sleep_in_cell,
    "collective": stuck_in_collective,
    "native": hold_the_gil_in_c,
}
"""Busy ranks started with ``cluster.apply`` (``train`` is started by ``train_forever``)."""
