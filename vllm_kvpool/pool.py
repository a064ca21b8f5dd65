"""The logical pool (scheduler side): devices as fixed-size chunk slots (``ChunkLayout``), the
index, placement, eviction and device health, and the jobs the workers run: a save plan becomes
``ChunkSave`` messages, a prefix hit ``ChunkRead`` ones (``save_jobs``, ``lookup`` and
``load_jobs``; the scheduler, ``LocalPool``, the benchmarks and the GPU kit all build them here).
Pure Python, no vLLM and no I/O: workers do the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.eviction import evict_lru
from vllm_kvpool.index import BlockHash, ChunkEntry, ChunkHit, ChunkIndex, ChunkLocation
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.metrics import DeviceUsage, LookupCounters, PoolStatus, TransferCounters
from vllm_kvpool.migration import DEFAULT_MARGIN, pick_moves
from vllm_kvpool.persist import RestoredChunk
from vllm_kvpool.placement import DeviceWeights, Placement
from vllm_kvpool.protocol import ChunkMove, ChunkRead, ChunkSave, WorkerReport

logger = logging.getLogger("vllm_kvpool")

@dataclass
class SlotAllocator:
    total: int
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.total - 1, -1, -1))  # pop() hands out low slots first

    def take(self) -> int:
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def reserve(self, slots: set[int]) -> None:
        """Take these particular slots (chunks restored after a restart)."""
        self.free = [s for s in self.free if s not in slots]

    @property
    def num_free(self) -> int:
        return len(self.free)


@dataclass(frozen=True)
class PlannedSave:
    entry: ChunkEntry
    first_block: int  # index in the request of the chunk's first block


GroupBlockIds = Sequence[Sequence[int]]  # a request's block ids per KV cache group (vLLM's order)


def prefix_blocks(hits: Sequence[ChunkHit]) -> int:
    """Blocks of the request the hits cover (they are a prefix, in order)."""
    return hits[-1].first_block + hits[-1].num_blocks if hits else 0


def read_jobs(layout: ChunkLayout, hits: Sequence[ChunkHit], group_ids: GroupBlockIds,
              load_from: int = 0,
              hit_end: int | None = None) -> list[tuple[ChunkRead, ChunkEntry]]:  # fmt: skip
    """The reads that put ``hits`` back into a request's blocks (``group_ids``: its block
    table per KV cache group), for a hit ending at block ``hit_end`` (default: where the
    hits end) whose blocks before ``load_from`` vLLM already holds: every block of the
    full-attention groups, the window at ``hit_end`` of the sliding-window ones. A chunk
    restored after a restart is verified on its first read, whatever the config."""
    end = prefix_blocks(hits) if hit_end is None else hit_end
    out = []
    for hit in hits:
        entry, loc = hit.entry, hit.entry.location
        wanted = {s.group.group_id: (lo, hi) for s, lo, hi
                  in layout.loads(hit.first_block, loc.num_blocks, load_from, end)}  # fmt: skip
        if not wanted:
            continue  # nothing of this chunk is missing from vLLM's KV
        ids: list[int] = []
        sections = []
        for s in layout.sections(loc.num_blocks):
            lo, hi = wanted.get(s.group.group_id, (0, 0))
            ids += group_ids[s.group.group_id][lo:hi]
            sections.append((max(0, lo - hit.first_block - s.first), hi - lo))
        out.append((ChunkRead(entry.key, loc.device, loc.slot, loc.num_blocks,
                              dict(entry.checksums), tuple(ids), tuple(sections),
                              verify=not entry.validated), entry))  # fmt: skip
    return out


def save_job(layout: ChunkLayout, req_id: str, planned: PlannedSave,
             group_ids: GroupBlockIds) -> ChunkSave:
    """The worker job of a planned save: the chunk's stored blocks of every section, from the
    request's block table per KV cache group (``group_ids``)."""
    loc, first = planned.entry.location, planned.first_block
    ids = tuple(b for s in layout.sections(loc.num_blocks) for b in
                group_ids[s.group.group_id][first + s.first : first + s.first
                                            + s.num_blocks])  # fmt: skip
    return ChunkSave(req_id, planned.entry.key, loc.device, loc.slot, ids, loc.num_blocks,
                     tuple(planned.entry.block_hashes))  # fmt: skip


class UnifiedPool:
    """Index + slots + placement + eviction over all devices of one pool config."""

    def __init__(
        self,
        config: PoolConfig,
        layout: ChunkLayout,
        weights: DeviceWeights,
        world_size: int = 1,
    ) -> None:
        layout.check_capacity(config)
        self.config = config
        self.layout = layout
        self.weights = weights
        self.world_size = world_size
        self.index = ChunkIndex()
        self.slots = [SlotAllocator(layout.num_slots(d)) for d in config.devices]
        self.placement = Placement(config.placement, len(config.devices))
        self.lookups = LookupCounters()
        self.transfers = TransferCounters()
        self.moves: dict[BlockHash, tuple[int, int, set[int]]] = {}  # key -> dst, slot, ranks

    # -- lookups ---------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> list[ChunkHit]:
        """Committed chunks on healthy devices covering the longest prefix of ``hashes``."""
        hits = self.index.match_prefix(hashes, self.layout.blocks_per_chunk,
                                       self.layout.layout_version)  # fmt: skip
        for n, hit in enumerate(hits):
            if self.weights.failed[hit.entry.location.device]:
                return hits[:n]
        return hits

    def lookup(self, hashes: Sequence[BlockHash]) -> list[ChunkHit]:
        """The hits a load may use: the matched prefix, cut back to where every sliding window
        is stored (the end of a stored chunk) when the layout has sliding-window groups."""
        return self.lookup_pending(hashes)[0]

    def lookup_pending(self, hashes: Sequence[BlockHash]) -> tuple[list[ChunkHit], int]:
        """``lookup``, and the blocks of ``hashes`` the matched prefix would cover once the
        chunk right after it commits, when that chunk is being written (else 0): a request
        may wait for that save instead of recomputing what it is about to store."""
        hits = self.match(hashes)
        usable = self.layout.usable_hit_blocks(
            [(h.first_block, h.entry.location.num_blocks, h.num_blocks) for h in hits])
        bpc = self.layout.blocks_per_chunk
        first = prefix_blocks(hits)
        pending = 0
        if (not hits or hits[-1].num_blocks == bpc) and first < len(hashes):
            entry = self.index.get(hashes[first])
            # uncommitted: reserved by a save plan, not yet reported written by every rank
            # (a failed write or device drops it from the index)
            if entry is not None and not entry.committed:
                pending = first + entry.matching_blocks(hashes[first : first + bpc])
        return [h for h in hits if h.first_block < usable], pending

    def load_jobs(self, hits: Sequence[ChunkHit], group_ids: GroupBlockIds, load_from: int = 0,
                  hit_end: int | None = None) -> list[tuple[ChunkRead, ChunkEntry]]:  # fmt: skip
        """``read_jobs`` over this pool's layout."""
        return read_jobs(self.layout, hits, group_ids, load_from, hit_end)

    def is_stored(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether the pool holds (or is writing) this chunk at least this long."""
        entry = self.index.get(hashes[0])
        return entry is not None and len(entry.block_hashes) >= len(hashes)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """A request asked about ``query_tokens``; ``hit_tokens`` of them will come from here."""
        self.lookups.query_tokens += query_tokens
        self.lookups.hit_tokens += hit_tokens

    def record_load(self, entries: Sequence[ChunkEntry]) -> None:
        """One request's load of these chunks was issued."""
        self.lookups.loads += 1
        self.lookups.restored_hits += sum(e.restored for e in entries)

    def pin(self, entries: Sequence[ChunkEntry]) -> None:
        for e in entries:
            e.readers += 1
            self.index.touch(e.key)

    def unpin(self, entries: Sequence[ChunkEntry], completed: bool = True) -> None:
        """A load finished; entries still indexed passed their checksum (corrupt ones were
        invalidated by the same worker report), so a restored chunk counts as validated.
        ``completed`` False: the reader went away (an engine died), nothing was verified."""
        for e in entries:
            if completed and not e.dead:
                e.validated = True
            self._unpin(e)

    def _unpin(self, e: ChunkEntry) -> None:
        e.readers -= 1
        if e.readers == 0:
            if e.dead:
                self._release(e)
            else:
                self._free_superseded(e)

    # -- migration -------------------------------------------------------------------------
    def plan_moves(self, margin: float = DEFAULT_MARGIN, limit: int = 1 << 30) -> list[ChunkMove]:
        """Background moves of stored chunks off devices whose share time (``migration``)
        exceeds another's by ``margin``: destination slots reserved, the chunks pinned (never
        evicted meanwhile; loads keep reading the old copy). Newest chunks move first (the
        prefixes in use). The workers copy them (``ChunkMove``); ``apply_report`` swaps."""
        n = len(self.config.devices)
        movable: list[list[ChunkEntry]] = [[] for _ in range(n)]
        stored = [0] * n
        for e in reversed(list(self.index.oldest_first())):  # newest first
            stored[e.location.device] += e.location.nbytes
            if (e.committed and not e.readers and not e.dead and not e.moving
                    and not self.weights.failed[e.location.device]):  # fmt: skip
                movable[e.location.device].append(e)
        # the split the guard keeps, not the estimates: an estimate measured below a device's
        # knee would move chunks past it (``migration``)
        picks = pick_moves(stored, self.weights.kept_shares(), self._free_slots(),
                           [[e.location.nbytes for e in m] for m in movable], margin, limit)  # fmt: skip
        jobs = []
        for src, i, dst in picks:
            e = movable[src][i]
            slot = self.slots[dst].take()
            e.readers += 1  # pinned until the move settles
            e.moving = True
            self.moves[e.key] = (dst, slot, set())
            jobs.append(ChunkMove(e.key, e.location.device, e.location.slot, dst, slot,
                                  e.location.num_blocks, dict(e.checksums), e.block_hashes))  # fmt: skip
        self.lookups.moves_planned += len(jobs)
        return jobs

    def _settle_move(self, key: BlockHash, rank: int, copied: bool) -> None:
        """One rank's copy of a moving chunk is done (``copied``) or failed. Once every rank
        copied it, the chunk's location is the new slot; the old one is freed once no load
        reads it. A failed copy, or a chunk dropped meanwhile, gives the new slot back."""
        move = self.moves.get(key)
        if move is None:
            return
        dst, slot, ranks = move
        entry = self.index.get(key)
        if copied and entry is not None and entry.moving and not entry.dead:
            ranks.add(rank)
            if len(ranks) < self.world_size:
                return
            old = entry.location
            entry.location = replace(old, device=dst, slot=slot)
            entry.superseded.append((old.device, old.slot))
            self.lookups.moves_done += 1
        else:
            self.slots[dst].give(slot)
            self.lookups.moves_failed += 1
        del self.moves[key]
        if entry is not None:
            entry.moving = False
            self._unpin(entry)

    def _free_superseded(self, e: ChunkEntry) -> None:
        for device, slot in e.superseded:
            self.slots[device].give(slot)
        e.superseded.clear()

    def restore(self, device: int, chunks: Sequence[RestoredChunk]) -> int:
        """Index chunks a previous run left on ``device`` (oldest first, so LRU order holds);
        each is verified on its first read. Returns how many were indexed."""
        todo = [c for c in chunks if c.slot < self.slots[device].total
                and c.block_hashes[0] not in self.index]  # fmt: skip
        self.slots[device].reserve({c.slot for c in todo})
        for c in todo:
            loc = ChunkLocation(device, c.slot, c.num_blocks, c.nbytes,
                                self.layout.layout_version)  # fmt: skip
            entry = self.index.reserve(c.block_hashes[0], c.block_hashes, loc)
            entry.checksums = dict(c.checksums)
            entry.committed = len(entry.checksums) >= self.world_size
            entry.validated, entry.restored = False, True
        self.lookups.restored += len(todo)
        return len(todo)

    # -- saves -----------------------------------------------------------------------------
    def shorter_copy_unsettled(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether a shorter copy of this chunk is still being written (not yet replaceable)."""
        entry = self.index.get(hashes[0])
        return entry is not None and not entry.committed and len(entry.block_hashes) < len(hashes)

    def plan_saves(
        self, req_id: str, chunks: Sequence[tuple[int, Sequence[BlockHash]]]
    ) -> list[PlannedSave]:
        """Reserve slots for new chunks ``(first_block, block_hashes)`` of one request.

        Chunks already indexed (committed or being written by another request) are skipped,
        unless the indexed one is a shorter, idle copy of the same chunk (the prompt's partial
        last chunk, now filled by generated tokens): that one is replaced.
        When the pool is full the least recently used chunks are evicted; if nothing can be
        evicted the remaining chunks are simply not saved (a future miss, never an error).
        Placement stops at the first chunk that cannot be placed: a prefix with a hole in it
        could never be matched past the hole.
        """
        todo = []
        for first, hashes in chunks:
            entry = self.index.get(hashes[0])
            if entry is not None and entry.committed and not entry.readers \
                    and len(entry.block_hashes) < len(hashes):  # fmt: skip
                self.index.remove(entry.key)  # idle: its slot is free at once
                self._release(entry)
                entry = None
            if entry is None:
                todo.append((first, tuple(hashes)))
        if not todo:
            return []
        free_total = sum(self._free_slots())
        if free_total < len(todo):
            victims = evict_lru(self.index, len(todo) - free_total, self._release)
            self.lookups.evictions += len(victims)
        devices = self.placement.assign(req_id, len(todo), self.weights.for_placement(),
                                        self._free_slots())  # fmt: skip
        self.weights.placed(self.placement.stripes[req_id].counts)
        self.lookups.save_skipped_full += len(todo) - len(devices)
        planned = []
        for (first, hashes), device in zip(todo, devices, strict=False):
            loc = ChunkLocation(device=device, slot=self.slots[device].take(),
                                num_blocks=len(hashes),
                                nbytes=self.layout.nbytes(len(hashes)),
                                layout_version=self.layout.layout_version)  # fmt: skip
            planned.append(PlannedSave(self.index.reserve(hashes[0], hashes, loc), first))
        self.lookups.saves += len(planned)
        return planned

    def save_jobs(self, req_id: str, chunks: Sequence[tuple[int, Sequence[BlockHash]]],
                  group_ids: GroupBlockIds) -> list[ChunkSave]:  # fmt: skip
        """``plan_saves`` as the workers' jobs (``save_job``)."""
        return [save_job(self.layout, req_id, p, group_ids) for p in self.plan_saves(req_id, chunks)]

    def acknowledge_save(self, key: BlockHash, rank: int, checksum: int) -> None:
        self.index.acknowledge(key, rank, checksum, self.world_size)

    def forget_request(self, req_id: str) -> None:
        self.placement.forget(req_id)

    # -- failures --------------------------------------------------------------------------
    def invalidate(self, key: BlockHash) -> None:
        """Drop a chunk (failed write, corrupt read): later lookups miss and recompute it."""
        entry = self.index.remove(key)
        if entry is None:
            return
        self.lookups.invalidated += 1
        if entry.readers:
            entry.dead = True
        else:
            self._release(entry)

    def withdraw(self, entry: ChunkEntry) -> bool:
        """Take a chunk whose writer died before it committed out of the index (never served);
        its slot stays taken until ``free_slot``, once nothing of that writer can still write
        into it. False when ``entry`` is no longer this pool's unsettled copy of its key."""
        if self.index.get(entry.key) is not entry or entry.committed:
            return False
        self.index.remove(entry.key)
        self.lookups.invalidated += 1
        return True

    def free_slot(self, entry: ChunkEntry) -> None:
        """Give a withdrawn chunk's slot back."""
        self._release(entry)

    def fail_device(self, device: int) -> None:
        """A device failed: its chunks become misses, it takes no new chunks, the pool serves."""
        self.weights.fail(device)
        for entry in self.index.on_device(device):
            self.invalidate(entry.key)

    def restore_device(self, device: int) -> None:
        """A failed device works again: it takes new chunks (the ones it held stay misses)."""
        self.weights.restore(device)

    def apply_report(self, report: WorkerReport) -> list[BlockHash]:
        """Fold a worker report in; returns the chunks whose save settled (written or failed)."""
        settled = []
        for key, rank, checksum in report.committed:
            self.acknowledge_save(key, rank, checksum)
            entry = self.index.get(key)
            if entry is None or entry.committed:
                settled.append(key)
        for key in report.failed_saves:
            self.invalidate(key)
            settled.append(key)
        for key in report.corrupt:
            self.invalidate(key)
        names = [d.name for d in self.config.devices]
        for device, reason in report.failed_devices.items():
            if not self.weights.failed[device]:
                logger.error("kvpool: %s failed (%s); its chunks are now misses", names[device],
                             reason)  # fmt: skip
                self.fail_device(device)
        for device in report.recovered_devices:
            if self.weights.failed[device] and device not in report.failed_devices:
                logger.warning("kvpool: %s works again; it takes new chunks", names[device])
                self.restore_device(device)
        for key, rank, copied in report.moved:
            self._settle_move(key, rank, copied)
        read_bytes, read_seconds = [0] * len(names), [0.0] * len(names)
        for device, op, nbytes, seconds in report.observations:
            if self.weights.observe(device, op, nbytes, seconds):
                logger.info("kvpool: %s: measured %.2f GB/s replaces the probe's %.2f as its "
                            "placement weight", names[device], self.weights.gbps[device],
                            self.weights.probe_gbps[device])  # fmt: skip
            if op == "read":
                read_bytes[device] += nbytes
                read_seconds[device] += seconds
        self.weights.observe_fetch(read_bytes, read_seconds)
        self.transfers.merge(report.counters)
        return settled

    def clear(self) -> None:
        """Drop every committed chunk (vLLM's reset of the prefix cache)."""
        for entry in list(self.index.oldest_first()):
            if entry.committed:
                self.invalidate(entry.key)

    # -- reporting -------------------------------------------------------------------------
    def status(self) -> PoolStatus:
        w = self.weights
        kept = w.kept_shares()
        usage = [
            DeviceUsage(d.name, d.kind, alloc.total - alloc.num_free, alloc.total,
                        self.layout.slot_bytes, w.reads[i].gbps, w.failed[i], w.probe_gbps[i],
                        w.reads[i].measured_gbps, w.writes[i].measured_gbps, kept[i])  # fmt: skip
            for i, (d, alloc) in enumerate(zip(self.config.devices, self.slots, strict=True))
        ]
        return PoolStatus(usage, self.lookups, self.transfers, self.config.placement,
                          self.config.chunk_tokens, copies=self.world_size)  # fmt: skip

    def _free_slots(self) -> list[int]:
        return [0 if failed else a.num_free
                for a, failed in zip(self.slots, self.weights.failed, strict=True)]  # fmt: skip

    def _release(self, entry: ChunkEntry) -> None:
        self.slots[entry.location.device].give(entry.location.slot)
        self._free_superseded(entry)
