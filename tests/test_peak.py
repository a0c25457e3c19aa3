"""``metrics.peak.PeakTracker``: the most tensor bytes alive at once on a CPU rank, the figure
the predictions are checked against (``tests/test_predictions.py``)."""

from __future__ import annotations

import pytest
import torch

from axon_nb.metrics.peak import PeakTracker

N = 16384  # float32 elements: 64 KiB


def test_tensors_alive_at_once_are_counted_once_each() -> None:
    with PeakTracker() as tracker:
        a = torch.ones(N)
        a.add_(1)  # in place: the same storage
        view = a[1:]  # a view: the same storage
        b = torch.ones(N)
        del a, view, b
        c = torch.ones(N)
    assert tracker.peak == 2 * N * 4
    assert tracker.current == N * 4
    del c


def test_memory_given_back_without_the_storage_dying_is_not_counted_twice() -> None:
    """FSDP frees a gathered parameter with ``untyped_storage().resize_(0)``: the storage
    object lives on, and the allocator may hand its memory to the next tensor. That tensor is
    a new allocation, counted; and the old storage's death, later, must not take its bytes off.
    (Whether the allocator reuses the address is up to it: tried until it does.)"""
    for n in (256, 1024, 64, 4096) * 50:
        with PeakTracker() as tracker:
            gathered = torch.ones(n)
            address = gathered.data_ptr()
            gathered.untyped_storage().resize_(0)
            activation = torch.ones(n)
            if activation.data_ptr() != address:
                continue
            del gathered  # the resized storage dies now
            gradient = torch.ones(n)
        # the activation and the gradient are alive together
        assert tracker.peak == 2 * n * 4
        del activation, gradient
        return
    pytest.fail("the allocator never gave a freed address to the next tensor")
