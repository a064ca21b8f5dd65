"""Simulator of PyTorch's CUDA caching allocator (native backend, default configuration).

It replays a stream of tensor allocations and frees and reports what
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` would report for it. The rules
follow ``c10/cuda/CUDACachingAllocator.cpp`` with default ``PYTORCH_CUDA_ALLOC_CONF``:

* every request is rounded up to a multiple of 512 B (minimum 512 B);
* requests <= 1 MiB come from the *small* pool, whose segments are 2 MiB;
* larger requests come from the *large* pool: 1-10 MiB requests get a 20 MiB segment,
  >= 10 MiB requests a segment rounded up to a multiple of 2 MiB;
* a free cached block is reused best-fit (smallest block that fits, then lowest address);
* a block is split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool);
* freed blocks merge with free neighbours of the same segment; segments are never returned
  to the driver unless a ``cudaMalloc`` would exceed the capacity, in which case all fully
  free segments are released and the allocation is retried (then OOM).
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
    """Replay allocations with :meth:`malloc` / :meth:`free`; read :attr:`stats`."""

    capacity: int | None = None  # device bytes available to the allocator; None = unbounded
    stats: AllocatorStats = field(default_factory=AllocatorStats)

    def __post_init__(self) -> None:
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._by_key: dict[tuple[int, int], _Block] = {}
        self._live: dict[int, tuple[_Block, int]] = {}
        self._next_addr = 0
        self._next_handle = 0

    # -- public API -------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small)
        if block is None:
            block = self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
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
    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
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

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour.addr < block.addr else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = segment_size(size)
        s = self.stats
        if self.capacity is not None and s.reserved + seg > self.capacity:
            self._release_free_segments()
            if s.reserved + seg > self.capacity:
                raise SimulatedOutOfMemoryError(
                    f"simulated OOM: request of {size} B needs a {seg} B segment; reserved="
                    f"{s.reserved} B, capacity={self.capacity} B"
                )
        block = _Block(self._next_addr, seg, small)
        self._next_addr += seg
        s.reserved += seg
        s.num_segments += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return block

    def _release_free_segments(self) -> None:
        for small in (False, True):
            for key in list(self._free[small]):
                block = self._by_key[key]
                if block.prev is None and block.next is None:  # a whole, unsplit segment
                    self._drop_free(block)
                    self.stats.reserved -= block.size
                    self.stats.num_segments -= 1
                    self.stats.num_releases += 1
