"""The chunk index: vLLM block-hash chain -> where the chunk's KV lives in the pool.

A chunk is ``blocks_per_chunk`` consecutive vLLM blocks of one request. Its key is the hash of
its FIRST block; since vLLM's block hash chains over every earlier block, the key identifies the
whole prefix up to that chunk, so requests that share a prefix share chunks. Each entry keeps
the block hashes it covers, so a request whose prefix diverges inside a chunk still reuses the
matching leading blocks of that chunk. The index is ordered oldest-use first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

BlockHash = bytes


@dataclass(frozen=True)
class ChunkLocation:
    device: int  # index into the pool's device list
    slot: int  # fixed-size extent number on that device
    num_blocks: int
    nbytes: int  # payload bytes (num_blocks * bytes per block)
    layout_version: int  # fingerprint of the KV layout the bytes were written with


@dataclass
class ChunkEntry:
    key: BlockHash
    block_hashes: tuple[BlockHash, ...]
    location: ChunkLocation
    checksums: dict[int, int] = field(default_factory=dict)  # worker rank -> XXH3-64 of its shard
    committed: bool = False  # visible to lookups only once every worker has written it
    readers: int = 0  # in-flight loads; a chunk being read is never evicted
    dead: bool = False  # dropped from the index while still being read: free its slot later
    validated: bool = True  # False: restored after a restart, checksum not yet seen on a read
    restored: bool = False  # written by a previous run (found in an SSD's index at start-up)
    moving: bool = False  # a background copy to another device is under way (``migration``)
    # (device, slot) of copies the chunk moved away from, freed once no load reads them
    superseded: list[tuple[int, int]] = field(default_factory=list)

    def matching_blocks(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for mine, theirs in zip(self.block_hashes, hashes, strict=False):
            if mine != theirs:
                break
            n += 1
        return n


@dataclass(frozen=True)
class ChunkHit:
    entry: ChunkEntry
    first_block: int  # index of the chunk's first block in the request
    num_blocks: int  # leading blocks of the chunk that match the request


@dataclass
class ChunkIndex:
    entries: OrderedDict[BlockHash, ChunkEntry] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.entries

    def get(self, key: BlockHash) -> ChunkEntry | None:
        return self.entries.get(key)

    def match_prefix(
        self, hashes: Sequence[BlockHash], blocks_per_chunk: int, layout_version: int
    ) -> list[ChunkHit]:
        """Committed chunks covering the longest prefix of ``hashes`` (stops at the first gap)."""
        hits: list[ChunkHit] = []
        for first in range(0, len(hashes), blocks_per_chunk):
            entry = self.entries.get(hashes[first])
            if (entry is None or not entry.committed
                    or entry.location.layout_version != layout_version):  # fmt: skip
                break
            n = entry.matching_blocks(hashes[first : first + blocks_per_chunk])
            if n == 0:
                break
            hits.append(ChunkHit(entry, first, n))
            if n < blocks_per_chunk:
                break
        return hits

    def reserve(self, key: BlockHash, hashes: Sequence[BlockHash], loc: ChunkLocation) -> ChunkEntry:
        """An entry for a chunk being written (invisible to lookups until ``commit``)."""
        assert key not in self.entries, "chunk already indexed"
        entry = ChunkEntry(key, tuple(hashes), loc)
        self.entries[key] = entry
        return entry

    def acknowledge(self, key: BlockHash, rank: int, checksum: int, world_size: int) -> bool:
        """Record one worker's finished write; the chunk is committed once all have written."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        entry.checksums[rank] = checksum
        if len(entry.checksums) >= world_size and not entry.committed:
            entry.committed = True
            self.entries.move_to_end(key)
        return entry.committed

    def remove(self, key: BlockHash) -> ChunkEntry | None:
        return self.entries.pop(key, None)

    def touch(self, key: BlockHash) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def oldest_first(self) -> Iterator[ChunkEntry]:
        return iter(list(self.entries.values()))

    def on_device(self, device: int) -> list[ChunkEntry]:
        return [e for e in self.entries.values() if e.location.device == device]
