"""The persistent index of SSD-resident chunks: one self-describing record per slot.

Every SSD keeps, after its data region, an index region of ``num_slots`` fixed-size records;
record ``s`` describes the chunk in slot ``s``: its block hashes (the key is the first), block
count, byte length, this rank's XXH3-64, the pool fingerprint (KV layout + model identity + block
hashing, see ``layout.build``), a sequence number and a checksum of the record itself.

Crash consistency: before a slot is overwritten its old record is erased and made durable; a
worker writes a chunk's record only after the chunk's data write completed and was made durable
(``fdatasync`` of the file or block device). So a record that reads back intact always describes
complete data still in its slot; a torn record fails its own checksum and is ignored, and so
does every record of a build that checksummed with XXH64 (before XXH3-64). Restored
chunks are still verified on their first read, whatever ``verify_checksums`` says (media can
change under the pool).
At start-up the scheduler rebuilds the index from the records whose fingerprint matches
(records of another model, dtype, block size, chunk size or TP layout are ignored and their
slots reused). Host-memory chunks are not persisted: they are lost on restart.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvpool.native import kvio

logger = logging.getLogger("vllm_kvpool")

MAGIC = b"KVPR"
FORMAT = 1
# magic, format, body bytes, n_hashes, record checksum, seq, slot, num_slots, slot_bytes,
# num_blocks, nbytes, fingerprint, data checksum; the body is the hashes, each length-prefixed
_HEAD = struct.Struct("<4sHHHxxQQQQQQQQQ")
MAX_HASH_BYTES = 64
RECORD_ALIGN = 4096
SCAN_BYTES = 8 << 20  # index bytes read per pread at start-up


def record_bytes(blocks_per_chunk: int) -> int:
    """Size of one record (room for ``blocks_per_chunk`` hashes of up to 64 bytes)."""
    need = _HEAD.size + blocks_per_chunk * (1 + MAX_HASH_BYTES)
    return -(-need // RECORD_ALIGN) * RECORD_ALIGN


@dataclass(frozen=True)
class ChunkRecord:
    slot: int
    block_hashes: tuple[bytes, ...]
    num_blocks: int
    nbytes: int
    checksum: int  # XXH3-64 of this rank's bytes of the chunk
    fingerprint: int
    seq: int  # larger = written later
    num_slots: int
    slot_bytes: int

    @property
    def key(self) -> bytes:
        return self.block_hashes[0]

    def encode(self, size: int) -> bytes:
        if any(not 0 < len(h) <= MAX_HASH_BYTES for h in self.block_hashes):
            raise ValueError(f"kvpool: block hashes over {MAX_HASH_BYTES} bytes cannot be indexed")
        body = b"".join(bytes([len(h)]) + h for h in self.block_hashes)
        head = _HEAD.pack(MAGIC, FORMAT, len(body), len(self.block_hashes), 0, self.seq, self.slot,
                          self.num_slots, self.slot_bytes, self.num_blocks, self.nbytes,
                          self.fingerprint, self.checksum)  # fmt: skip
        raw = bytearray(head + body)
        if len(raw) > size:
            raise ValueError(f"kvpool: a record of {len(raw)} bytes does not fit {size}")
        raw += bytes(size - len(raw))
        struct.pack_into("<Q", raw, 12, kvio().checksum(bytes(raw)))
        return bytes(raw)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkRecord | None:
        """The record in ``raw``, or None when it is empty, torn or not a record."""
        if len(raw) < _HEAD.size or bytes(raw[:4]) != MAGIC:
            return None
        (_, fmt, body_len, n_hashes, stored, seq, slot, num_slots, slot_bytes, num_blocks, nbytes,
         fingerprint, checksum) = _HEAD.unpack_from(raw)  # fmt: skip
        if fmt != FORMAT or not n_hashes or _HEAD.size + body_len > len(raw):
            return None
        zeroed = bytearray(raw)
        struct.pack_into("<Q", zeroed, 12, 0)
        if kvio().checksum(bytes(zeroed)) != stored:
            return None
        body = bytes(raw[_HEAD.size : _HEAD.size + body_len])
        hashes, pos = [], 0
        while pos < len(body):
            n = body[pos]
            hashes.append(body[pos + 1 : pos + 1 + n])
            pos += 1 + n
        if len(hashes) != n_hashes or pos != len(body):
            return None
        return cls(slot, tuple(hashes), num_blocks, nbytes, checksum, fingerprint, seq, num_slots,
                   slot_bytes)  # fmt: skip


def scan_records(path: str, index_offset: int, num_slots: int, size: int) -> list[ChunkRecord]:
    """Every intact record of a device's index region (a missing file has none).

    Read once at start-up with ordinary reads (then dropped from the page cache); the data
    path itself never goes through the page cache.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    records = []
    try:
        per_read = max(1, SCAN_BYTES // size)
        for first in range(0, num_slots, per_read):
            n = min(per_read, num_slots - first)
            raw = os.pread(fd, n * size, index_offset + first * size)
            for i in range(len(raw) // size):
                rec = ChunkRecord.decode(memoryview(raw)[i * size : (i + 1) * size])
                if rec is not None and rec.slot == first + i:
                    records.append(rec)
            if len(raw) < n * size:
                break  # shorter file: no records beyond
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, index_offset, num_slots * size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return records


@dataclass(frozen=True)
class RestoredChunk:
    """A chunk every rank has an intact, matching record for."""

    slot: int
    block_hashes: tuple[bytes, ...]
    num_blocks: int
    nbytes: int
    checksums: dict[int, int]  # rank -> checksum
    seq: int


def merge_ranks(per_rank: Sequence[Sequence[ChunkRecord]], fingerprint: int, num_slots: int,
                slot_bytes: int, blocks_per_chunk: int) -> list[RestoredChunk]:  # fmt: skip
    """Chunks of one device whose records match this pool on every rank, oldest first; of two
    copies of one key (a partial prompt chunk and its full replacement) the longer, newer wins."""
    usable: list[dict[int, ChunkRecord]] = []
    for records in per_rank:
        usable.append({r.slot: r for r in records
                       if r.fingerprint == fingerprint and r.num_slots == num_slots
                       and r.slot_bytes == slot_bytes and r.slot < num_slots
                       and 0 < r.num_blocks <= blocks_per_chunk
                       and len(r.block_hashes) == r.num_blocks
                       and 0 < r.nbytes <= slot_bytes})  # fmt: skip
    if not usable:
        return []
    chunks: dict[bytes, RestoredChunk] = {}
    for slot, first in usable[0].items():
        same = [u.get(slot) for u in usable]
        if any(r is None or r.block_hashes != first.block_hashes for r in same):
            continue
        chunk = RestoredChunk(slot, first.block_hashes, first.num_blocks, first.nbytes,
                              {rank: r.checksum for rank, r in enumerate(same) if r is not None},
                              max(r.seq for r in same if r is not None))  # fmt: skip
        old = chunks.get(first.key)
        if old is None or (chunk.num_blocks, chunk.seq) > (old.num_blocks, old.seq):
            chunks[first.key] = chunk
    return sorted(chunks.values(), key=lambda c: c.seq)
