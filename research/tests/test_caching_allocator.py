"""research/caching_allocator.py against PyTorch's caching-allocator rules, case by case by hand."""

from __future__ import annotations

import caching_allocator
import pytest

MiB = 1 << 20


@pytest.fixture(scope="module")
def ca():
    return caching_allocator


def test_rounding_and_segment_sizes(ca):
    assert ca.round_size(1) == 512 and ca.round_size(513) == 1024
    assert ca.segment_size(ca.round_size(100)) == 2 * MiB  # small pool: 2 MiB buffers
    assert ca.segment_size(3 * MiB) == 20 * MiB  # 1-10 MiB: a 20 MiB segment to split
    assert ca.segment_size(11 * MiB) == 12 * MiB  # from 10 MiB: the request, rounded up to 2 MiB


def test_small_requests_share_a_two_mib_segment(ca):
    a = ca.CachingAllocator(capacity=1 << 30)
    for _ in range(4):
        a.malloc(512 * 1024)
    assert a.reserved == 2 * MiB and a.allocated == 2 * MiB
    a.malloc(1)  # full: a second segment
    assert a.reserved == 4 * MiB and a.allocated == 2 * MiB + 512


def test_mid_sized_requests_split_a_twenty_mib_segment_and_the_remainder_is_reused(ca):
    a = ca.CachingAllocator(capacity=1 << 30)
    x = a.malloc(3 * MiB)
    y = a.malloc(5 * MiB)  # from the 17 MiB left of the first segment
    assert a.reserved == 20 * MiB and a.allocated == 8 * MiB
    a.free(x)
    a.free(y)  # merges back with its neighbours into one 20 MiB block
    a.malloc(19 * MiB)  # fits the merged block: no new segment
    assert a.reserved == 20 * MiB and a.peak_reserved == 20 * MiB


def test_a_remainder_of_one_mib_or_less_is_not_split_off(ca):
    a = ca.CachingAllocator(capacity=1 << 30)
    a.malloc(11 * MiB)  # a 12 MiB segment; 1 MiB left is not more than kSmallSize: the block stays whole
    assert a.reserved == 12 * MiB and a.allocated == 12 * MiB


def test_best_fit_takes_the_smallest_block_that_fits(ca):
    a = ca.CachingAllocator(capacity=1 << 30)
    big, small = a.malloc(40 * MiB), a.malloc(16 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(14 * MiB)  # the 16 MiB block (2 MiB left, split off), not the 40
    a.malloc(40 * MiB)  # so the 40 MiB block is still whole
    assert a.reserved == 56 * MiB


def test_fragmentation_reserves_more_than_is_live(ca):
    """A long-lived allocation placed in a cached block splits it; what was freed around it cannot serve a
    request larger than either piece, so the allocator reserves a new segment."""
    a = ca.CachingAllocator(capacity=1 << 30)
    act = a.malloc(100 * MiB)
    a.free(act)
    state = a.malloc(30 * MiB)  # e.g. an optimizer state allocated after the first backward
    a.malloc(100 * MiB)  # 70 MiB left in the cached block: a new 100 MiB segment
    assert a.allocated == 130 * MiB and a.reserved == 200 * MiB
    a.free(state)


def test_a_full_device_releases_wholly_free_segments_then_runs_out(ca):
    a = ca.CachingAllocator(capacity=32 * MiB)
    x = a.malloc(30 * MiB)
    a.free(x)
    a.malloc(31 * MiB)  # does not fit the cached 30 MiB: release it, then a 32 MiB segment
    assert a.reserved == 32 * MiB and a.peak_reserved == 32 * MiB
    with pytest.raises(MemoryError):
        a.malloc(1 * MiB + 1)


def test_reset_peak_stats_restarts_the_peaks_from_now_and_keeps_the_high_water_marks(ca):
    """torch.cuda.reset_peak_memory_stats: max_memory_allocated/reserved read from the reset on; cached
    segments stay reserved, so the reserved peak restarts from them."""
    a = ca.CachingAllocator(capacity=1 << 30)
    x = a.malloc(100 * MiB)
    a.free(x)
    a.reset_peak_stats()
    assert (a.peak_allocated, a.peak_reserved) == (0, 100 * MiB)
    a.malloc(40 * MiB)  # served by the cached segment: nothing more reserved
    assert (a.peak_allocated, a.peak_reserved) == (40 * MiB, 100 * MiB)
    assert (a.high_water_allocated, a.high_water_reserved) == (100 * MiB, 100 * MiB)
