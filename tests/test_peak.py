"""``metrics.peak.PeakTracker``: the CPU peak follows storages, not addresses, so FSDP's
free-and-gather of its unsharded parameters (``UntypedStorage.resize_``, which no operator
sees) is counted as it happens, whatever addresses the allocator hands out."""

from __future__ import annotations

import torch

from axon_nb.metrics.peak import PeakTracker, attributed, mark_phase

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


def test_views_and_in_place_results_of_older_storage_are_not_counted_again() -> None:
    """A ``Linear``'s transposed weight (a view) and the optimizer's in-place update of a
    parameter return storage the step found (``held_bytes`` counts it): only storage an
    operator makes is new."""
    weight = torch.randn(64, 64)
    with PeakTracker() as tracker:
        weight.t()  # a view
        weight.add_(1.0)  # in place
        assert tracker.peak == 0
        made = weight * 2  # new storage
        assert tracker.current == made.numel() * 4


def test_the_peak_says_its_phase_and_what_it_was_made_of() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(512, 32)
    with PeakTracker() as tracker:
        with attributed("buckets"):
            bucket = torch.zeros(1000)  # alive all along
        mark_phase("forward")
        loss = model(x).square().mean()
        mark_phase("backward")
        loss.backward()
        mark_phase("step")
        for p in model.parameters():
            p.data.add_(p.grad)
    for p in model.parameters():
        tracker.label(p.grad, "grads")
    parts = tracker.breakdown()
    # activations (512 samples) dwarf the gradients: the peak is early in backward
    assert tracker.peak_phase == "backward"
    assert parts["activations"] >= 2 * 512 * 64 * 4  # the GELU's input and output, saved
    assert parts["buckets"] == bucket.numel() * 4
    assert "step temporaries" not in parts
    assert sum(parts.values()) == tracker.peak
    assert tracker.peak_excluding("buckets") == tracker.peak - bucket.numel() * 4
    # each phase's own most, counting what the phase before left alive
    by_phase = tracker.phase_peaks
    assert by_phase["backward"] == tracker.peak
    assert parts["activations"] + bucket.numel() * 4 <= by_phase["forward"] < tracker.peak
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert grads + bucket.numel() * 4 <= by_phase["step"] < by_phase["forward"]
