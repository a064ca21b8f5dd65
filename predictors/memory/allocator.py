"""Simulator of PyTorch's CUDA caching allocator (native backend), rule by rule.

It replays a stream of tensor allocations and frees and reports what
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` would report for it. Each rule
below names the function of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) it follows:

* ``round_size``: a request is rounded up to a multiple of ``kMinBlockSize`` = 512 B
  (minimum 512 B; ``roundup_power2_divisions`` is not modelled: off by default);
* ``get_pool``: requests <= ``kSmallSize`` (1 MiB) use the *small* pool, larger the *large*;
* ``get_allocation_size``: a new segment is ``kSmallBuffer`` (2 MiB) for the small pool,
  ``kLargeBuffer`` (20 MiB) for requests below ``kMinLargeAlloc`` (10 MiB), else the request
  rounded up to ``kRoundLarge`` (2 MiB);
* ``get_free_block``: best fit, the smallest cached block of the pool that fits, lowest
  address first (``BlockComparatorSize``); with ``max_split_size`` set, a request below it
  never takes an "oversize" block (>= ``max_split_size``), and an oversize request takes a
  cached block only if it is less than ``kLargeBuffer`` larger;
* ``should_split``: the rest of a block is split off as a new free block when it is >= 512 B
  (small pool, or any pool with ``expandable_segments``) or > 1 MiB (large pool, and only for
  requests below ``max_split_size``): a remainder of a large block may be split again by the
  next request as long as it stays above 1 MiB; oversize blocks are never split;
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment; segments stay cached;
* ``malloc``: search the pool, else ``alloc_block`` (cudaMalloc), else
  ``release_available_cached_blocks`` (only with ``max_split_size``: free cached oversize
  blocks, the smallest that covers the request or else the largest ones until enough) and
  retry, else ``release_cached_blocks`` (free every cached whole segment, both pools) and
  retry, else OOM;
* ``expandable_segments:True`` (``try_allocate_expandable_block``, ``map_block``,
  ``unmap_block``): each pool has one segment of virtual address space mapped in pages of
  ``kSmallBuffer`` (small pool) or ``kLargeBuffer`` (large pool); a request that fits no free
  block extends the free tail of the mapped range (or the range's end) by whole pages;
  releasing unmaps the free tail's whole pages.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


class SimulatedOutOfMemoryError(RuntimeError):
    """The simulated device ran out of memory (reserved + request > capacity)."""


class UnknownBlockError(KeyError):
    """A free of a handle the allocator never handed out (or already freed)."""


def round_size(nbytes: int) -> int:
    """Size of the block a request of ``nbytes`` occupies."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(block_bytes: int) -> int:
    """Size of the cudaMalloc'ed segment created for a rounded request that found no cached block."""
    if block_bytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_bytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((block_bytes + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass
class AllocatorStats:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    requested: int = 0  # sum of un-rounded live requests
    peak_requested: int = 0
    num_segments: int = 0
    num_allocs: int = 0
    num_releases: int = 0  # segments given back to the driver on memory pressure


@dataclass
class CachingAllocatorSim:
    """Replay allocations with :meth:`malloc` / :meth:`free`; read :attr:`stats`.

    ``max_split_size`` and ``expandable_segments`` are ``PYTORCH_CUDA_ALLOC_CONF``'s
    ``max_split_size_mb`` (here in bytes; None = unlimited, the default) and
    ``expandable_segments``."""

    capacity: int | None = None  # device bytes available to the allocator; None = unbounded
    stats: AllocatorStats = field(default_factory=AllocatorStats)
    max_split_size: int | None = None
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= LARGE_BUFFER:
            # CUDAAllocatorConfig::parseMaxSplitSize: max_split_size_mb must be > 20 MiB
            raise ValueError(f"max_split_size={self.max_split_size} must be > {LARGE_BUFFER} B")
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._by_key: dict[tuple[int, int], _Block] = {}
        self._live: dict[int, tuple[_Block, int]] = {}
        self._next_addr = 0
        self._next_handle = 0
        # expandable segments: the last block of each pool's mapped range
        self._tail: dict[bool, _Block | None] = {True: None, False: None}
        self._range_start: dict[bool, int] = {}

    @property
    def _max_split(self) -> int:
        return self.max_split_size if self.max_split_size is not None else 1 << 62

    # -- public API -------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small)
        if block is None:
            block = self._alloc_with_retries(size, small)
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, small, prev=block,
                          next=block.next)  # fmt: skip
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if self._tail[small] is block:
                self._tail[small] = rest
            self._put_free(rest)
        block.allocated = True
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (block, nbytes)
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.num_allocs += 1
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = max(s.peak_requested, s.requested)
        return handle

    def free(self, handle: int) -> None:
        try:
            block, nbytes = self._live.pop(handle)
        except KeyError:
            raise UnknownBlockError(f"handle={handle} is not a live allocation") from None
        self.stats.allocated -= block.size
        self.stats.requested -= nbytes
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._drop_free(neighbour)
                block = self._merge(block, neighbour)
        self._put_free(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: ``release_cached_blocks``."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: peaks restart from the current values."""
        s = self.stats
        s.peak_allocated, s.peak_reserved, s.peak_requested = s.allocated, s.reserved, s.requested

    @property
    def fragmentation(self) -> float:
        """Share of reserved bytes not held by live blocks."""
        s = self.stats
        return 0.0 if s.reserved == 0 else 1.0 - s.allocated / s.reserved

    # -- internals --------------------------------------------------------------------------
    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self._max_split and remaining > SMALL_SIZE

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        found = pool[i][0]
        if size < self._max_split <= found:
            return None  # do not return an oversized block for a smaller request
        if size >= self._max_split and found >= size + LARGE_BUFFER:
            return None  # an oversized request rounds up by less than kLargeBuffer only
        key = pool.pop(i)
        return self._by_key.pop(key)

    def _put_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], block.key)
        self._by_key[block.key] = block

    def _drop_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, block.key)
        del pool[i]
        del self._by_key[block.key]

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour.addr < block.addr else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        for small, tail in self._tail.items():
            if tail is second:
                self._tail[small] = first
        return first

    def _alloc_with_retries(self, size: int, small: bool) -> _Block:
        block = self._alloc_block(size, small)
        if block is None and self.max_split_size is not None and not small:
            if self._release_available_cached_blocks(size):
                block = self._alloc_block(size, small)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(size, small)
        if block is None:
            s = self.stats
            raise SimulatedOutOfMemoryError(
                f"simulated OOM: request of {size} B; reserved={s.reserved} B, "
                f"capacity={self.capacity} B"
            )
        return block

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.stats.reserved + nbytes <= self.capacity

    def _reserve(self, nbytes: int, new_segment: bool) -> None:
        s = self.stats
        s.reserved += nbytes
        s.num_segments += int(new_segment)
        s.peak_reserved = max(s.peak_reserved, s.reserved)

    def _alloc_block(self, size: int, small: bool) -> _Block | None:
        if self.expandable_segments:
            return self._extend(size, small)
        seg = segment_size(size)
        if not self._fits(seg):
            return None
        block = _Block(self._next_addr, seg, small)
        self._next_addr += seg
        self._reserve(seg, True)
        return block

    def _extend(self, size: int, small: bool) -> _Block | None:
        """Map whole pages at the end of the pool's range; a free tail block grows."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tail[small]
        have = tail.size if tail is not None and not tail.allocated else 0
        grow = page * -(-(size - have) // page)
        if not self._fits(grow):
            return None
        self._reserve(grow, tail is None)
        if have:
            self._drop_free(tail)
            tail.size += grow
            return tail
        block = _Block(self._next_addr, grow, small, prev=tail)
        if tail is not None:
            tail.next = block
        self._range_start.setdefault(small, self._next_addr)
        # ranges of the two pools never interleave: each reserves a wide address window
        self._next_addr += grow if tail is not None else max(grow, 1 << 44)
        self._tail[small] = block
        return block

    def _release_available_cached_blocks(self, size: int) -> bool:
        """Free cached oversize blocks: the smallest that covers ``size``, else the largest
        ones until their total does."""
        target = max(size, self._max_split)
        pool = self._free[False]
        i = bisect.bisect_left(pool, (target, -1))
        if i < len(pool):
            return self._release_block(self._by_key[pool[i]])
        released = 0
        for key in reversed(list(pool)):
            if released >= target or key[0] < self._max_split:
                break
            block = self._by_key[key]
            if self._release_block(block):
                released += key[0]
        return released >= target

    def _release_block(self, block: _Block) -> bool:
        if block.prev is not None or block.next is not None:
            return False  # part of a split segment: cudaFree needs the whole segment
        self._drop_free(block)
        self.stats.reserved -= block.size
        self.stats.num_segments -= 1
        self.stats.num_releases += 1
        return True

    def _release_cached_blocks(self) -> None:
        if self.expandable_segments:
            for small, tail in self._tail.items():
                if tail is None or tail.allocated:
                    continue
                # unmap the whole pages of the free tail; a partly used page stays mapped
                page = SMALL_BUFFER if small else LARGE_BUFFER
                offset = tail.addr - self._range_start[small]
                keep = page * -(-offset // page) - offset
                if keep >= tail.size:
                    continue
                self._drop_free(tail)
                self.stats.reserved -= tail.size - keep
                self.stats.num_releases += 1
                if keep:
                    tail.size = keep
                    self._put_free(tail)
                else:
                    self._tail[small] = tail.prev
                    if tail.prev is not None:
                        tail.prev.next = None
            return
        for small in (False, True):
            for key in list(self._free[small]):
                self._release_block(self._by_key[key])
