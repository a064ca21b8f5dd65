"""Eviction policy: LRU over the whole pool, never a chunk that is being read or written."""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvpool.index import ChunkEntry, ChunkIndex


def evictable(entry: ChunkEntry) -> bool:
    return entry.committed and entry.readers == 0


def evict_lru(
    index: ChunkIndex, slots_needed: int, release: Callable[[ChunkEntry], None]
) -> list[ChunkEntry]:
    """Evict oldest-used evictable chunks until ``slots_needed`` slots are freed (or none left).

    ``release`` returns the entry's slot to its device. Because the index is ordered by last
    use and a prefix's chunks are used together, the oldest prefixes go first.
    """
    victims: list[ChunkEntry] = []
    for entry in index.oldest_first():
        if len(victims) >= slots_needed:
            break
        if evictable(entry):
            index.remove(entry.key)
            release(entry)
            victims.append(entry)
    return victims
