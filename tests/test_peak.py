"""``metrics.peak.PeakTracker``: the CPU peak follows storages, not addresses, so FSDP's
free-and-gather of its unsharded parameters (``UntypedStorage.resize_``, which no operator
sees) is counted as it happens, whatever addresses the allocator hands out."""

from __future__ import annotations

import torch

from axon_nb.metrics.peak import PeakTracker

NUMEL = 4096
BYTES = NUMEL * 4


def _unsharded_parameter() -> tuple[torch.Tensor, torch.UntypedStorage]:
    """A parameter whose storage is freed, as FSDP leaves it between uses."""
    param = torch.zeros(NUMEL)
    storage = param.untyped_storage()
    storage.resize_(0)
    return param, storage


def test_a_storage_gathered_and_freed_by_resize_is_counted_while_it_is_allocated() -> None:
    param, storage = _unsharded_parameter()
    others = []  # other tensors alive meanwhile, so the allocator moves the storage around
    with PeakTracker() as tracker:
        for _ in range(3):
            storage.resize_(BYTES)  # all-gather's copy-out
            param.view(2, -1).add_(1)  # the forward uses it
            assert tracker.current == BYTES * (1 + len(others))
            storage.resize_(0)  # reshard
            assert tracker.current == BYTES * len(others)
            others.append(torch.ones(NUMEL))
        del others
        assert tracker.current == 0
    assert tracker.peak == BYTES * 3  # the third gather beside two others, counted once each


def test_memory_a_storage_had_before_the_tracker_is_not_counted_but_its_changes_are() -> None:
    held = torch.zeros(NUMEL)  # model state: the loop adds it to the peak itself
    with PeakTracker() as tracker:
        held.untyped_storage().resize_(0)
        assert tracker.current == -BYTES
        held.untyped_storage().resize_(BYTES)
        held.add_(1)
    assert (tracker.current, tracker.peak) == (0, 0)


def test_resize_is_restored_after_the_tracker_and_an_inner_one() -> None:
    original = torch.UntypedStorage.resize_
    _param, storage = _unsharded_parameter()
    with PeakTracker() as outer:
        with PeakTracker() as inner:
            storage.resize_(BYTES)
        assert torch.UntypedStorage.resize_ is not original  # the outer one still follows
        storage.resize_(0)
    assert torch.UntypedStorage.resize_ is original
    assert (inner.peak, outer.peak, outer.current) == (BYTES, BYTES, 0)
    storage.resize_(BYTES)  # untracked now: nothing changes
    assert outer.current == 0
