"""research/live_tensors.py, which measures torch's pipeline stack for the planner (torch_pp_memory.py):
it counts the storages ops create until they are garbage, follows FSDP2's in-place resize_, and records
what was live at the peak. Hand-counted bytes."""

from __future__ import annotations

import live_tensors
import torch


def test_peak_counts_what_was_live_at_once_and_frees_what_is_gone():
    tracker = live_tensors.LiveTensors()
    with tracker:
        kept = torch.zeros(1000)  # 4,000 B, kept
        tmp = torch.ones(500, dtype=torch.float64)  # 4,000 B, freed below
        view = kept[:10]  # a view: no new storage
        del tmp
        later = torch.empty(250)  # 1,000 B: the peak stays at 8,000
    assert tracker.peak == 8000
    assert tracker.current == 5000
    assert sum(tracker.at_peak.values()) == 8000
    assert any(label.startswith("zeros") for label in tracker.at_peak)
    assert view.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr() and later.numel() == 250


def test_storages_the_caller_counts_are_not_counted_again():
    weight = torch.zeros(1000)  # counted by the caller (a parameter)
    tracker = live_tensors.LiveTensors(already_counted=[weight])
    with tracker:
        flat = weight.view(-1)  # a view of it: nothing new
        grad = torch.ones_like(weight)  # 4,000 B
    assert tracker.peak == 4000 and flat.numel() == grad.numel()


def test_storage_resized_in_place_is_followed_and_resize_restored_after():
    tracker = live_tensors.LiveTensors()
    t = torch.empty(0)
    with tracker:
        t.untyped_storage().resize_(4096)  # FSDP2's re-gather: no op dispatches
        t.untyped_storage().resize_(0)  # and its free
        u = torch.empty(256)  # 1,024 B
    assert tracker.peak == 4096 and tracker.current == 1024 and u.numel() == 256
    assert torch.UntypedStorage.resize_ is live_tensors._original_resize
