"""PyTorch's CUDA caching allocator (the native backend at its default settings), simulated on sizes alone:
what `torch.cuda.max_memory_reserved()` reads after a sequence of allocations and frees.

The rules are c10/cuda/CUDACachingAllocator.cpp's (torch 2.1 .. 2.6, unchanged in these respects):
* every request is rounded up to a multiple of 512 bytes (`round_size`, kMinBlockSize);
* requests up to 1 MiB (kSmallSize) are served from a small pool, larger ones from a large pool;
* a request takes the smallest cached free block of its pool that fits, the lowest address first among
  equal sizes (`get_free_block`: the pool is ordered by size, then address);
* a block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool,
  `should_split` with max_split_size unset); the request keeps the low end;
* a miss cudaMallocs a new segment (`get_allocation_size`): 2 MiB for small requests, 20 MiB for requests
  under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB;
* a freed block merges with free neighbours of its segment (`free_block`);
* when cudaMalloc would exceed the device, every wholly free cached segment is released
  (`release_cached_blocks`) and the allocation retried; after that it is out of memory.
`reset_peak_stats` is torch.cuda.reset_peak_memory_stats: the peaks restart from the current figures (the
high-water marks keep the run's highest). Not modelled: streams (a block freed while another stream still
uses it waits for that stream's event), expandable segments and the allocator options;
nanotron_replay.py says what that leaves out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize
SMALL_BUFFER = 2 * MiB  # kSmallBuffer
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * -(-n // MIN_BLOCK)


def segment_size(n: int) -> int:
    """The cudaMalloc a miss of `n` rounded bytes makes."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-n // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None  # neighbours within the segment
    next: _Block | None = None


@dataclass
class CachingAllocator:
    capacity: int  # bytes the device lets cudaMalloc hand out
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0  # since the last reset_peak_stats, as torch.cuda.max_memory_reserved reads
    peak_allocated: int = 0  # since the last reset_peak_stats, as torch.cuda.max_memory_allocated reads
    high_water_reserved: int = 0  # the run's highest, never reset
    high_water_allocated: int = 0
    _free: dict[bool, list[tuple[int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _free_at: dict[int, _Block] = field(default_factory=dict)
    _live: dict[int, _Block] = field(default_factory=dict)
    _next_addr: int = 0
    _handles: int = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate; returns a handle for `free`. Raises MemoryError when the device is full."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small) or self._new_segment(segment_size(size), small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._put_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.high_water_allocated = max(self.high_water_allocated, self.allocated)
        self._handles += 1
        self._live[self._handles] = block
        return self._handles

    def reset_peak_stats(self) -> None:
        """torch.cuda.reset_peak_memory_stats: the peaks restart from what is allocated and reserved now."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        if block.next is not None and not block.next.allocated:
            self._drop_free(block.next)
            self._merge(block, block.next)
        if block.prev is not None and not block.prev.allocated:
            self._drop_free(block.prev)
            block = self._merge(block.prev, block)
        self._put_free(block)

    @staticmethod
    def _merge(left: _Block, right: _Block) -> _Block:
        """`right`, the block after `left` in their segment, becomes part of `left`."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, addr = pool.pop(i)
        return self._free_at.pop(addr)

    def _put_free(self, b: _Block) -> None:
        bisect.insort(self._free[b.small], (b.size, b.addr))
        self._free_at[b.addr] = b

    def _drop_free(self, b: _Block) -> None:
        pool = self._free[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]
        del self._free_at[b.addr]

    def _new_segment(self, size: int, small: bool) -> _Block:
        if self.reserved + size > self.capacity:
            self._release_cached()
            if self.reserved + size > self.capacity:
                raise MemoryError(f"out of memory: {size} bytes more on {self.reserved} reserved of {self.capacity}")
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.high_water_reserved = max(self.high_water_reserved, self.reserved)
        block = _Block(self._next_addr, size, small)
        self._next_addr += size + ROUND_LARGE  # segments never touch: no merging across them
        return block

    def _release_cached(self) -> None:
        for small in (True, False):
            for size, addr in list(self._free[small]):
                b = self._free_at[addr]
                if b.prev is None and b.next is None:
                    self._drop_free(b)
                    self.reserved -= size
