"""A chunk over vLLM's KV cache groups (worker side): one ``KVLayout`` per group, each moving
that group's section of the chunk (``geometry.ChunkLayout``: group-major, full attention first).

With the hybrid KV cache manager every group has its own block table (groups alias one KV
buffer, a block id being owned by one group at a time), so a message's ``block_ids`` are the
sections' ids one section after the other: a save's sections are the stored blocks of each group
(``ChunkSave.num_blocks`` says the chunk's length), a read's ``ChunkRead.sections`` say
``(skip, count)`` per section. With one group both are plain: one section, ``skip``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_kvpool.geometry import ChunkLayout, GroupLayout, Section
from vllm_kvpool.index import ChunkEntry
from vllm_kvpool.kv_layout import MAX_SEGMENTS, KVLayout, LayerPages, _merge_adjacent
from vllm_kvpool.protocol import ChunkRead, ChunkSave

SectionIds = Sequence[Sequence[int]]  # block ids per section, in the layout's section order


def section_save_ids(layout: ChunkLayout, first: int, num_blocks: int,
                     group_ids: Sequence[Sequence[int]]) -> tuple[int, ...]:  # fmt: skip
    """A save's ``block_ids``: each section's blocks from its group's block table
    (``group_ids[vLLM group id]``), section after section, for the chunk at request block
    ``first``."""
    return tuple(b for s in layout.sections(num_blocks) for b in
                 group_ids[s.group.group_id][first + s.first : first + s.first + s.num_blocks])  # fmt: skip


def section_read(layout: ChunkLayout, entry: ChunkEntry, first: int,
                 group_ids: Sequence[Sequence[int]], load_from: int,
                 hit_end: int) -> ChunkRead | None:  # fmt: skip
    """The read of the stored chunk ``entry`` (request blocks from ``first``) for a hit ending at
    block ``hit_end`` whose blocks before ``load_from`` vLLM already holds: full-attention groups
    get every block, sliding-window groups only the window at ``hit_end``. None: nothing to put
    back from this chunk."""
    loc = entry.location
    wanted = {s.group.group_id: (lo, hi) for s, lo, hi
              in layout.loads(first, loc.num_blocks, load_from, hit_end)}  # fmt: skip
    if not wanted:
        return None
    ids: list[int] = []
    sections = []
    for s in layout.sections(loc.num_blocks):
        lo, hi = wanted.get(s.group.group_id, (0, 0))
        ids += group_ids[s.group.group_id][lo:hi]
        sections.append((max(0, lo - first - s.first), hi - lo))
    return ChunkRead(entry.key, loc.device, loc.slot, loc.num_blocks, dict(entry.checksums), 0,
                     tuple(ids), tuple(sections))  # fmt: skip


class ChunkKV:
    def __init__(self, layout: ChunkLayout, groups: list[KVLayout]) -> None:
        self.layout = layout
        self.groups = groups
        self.layers: list[LayerPages] = [layer for g in groups for layer in g.layers]
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._where = [(gi, li) for gi, g in enumerate(groups) for li in range(len(g.layers))]

    @classmethod
    def from_kv_caches(cls, kv_caches: dict[str, torch.Tensor], layout: ChunkLayout,
                       num_blocks: int) -> ChunkKV:  # fmt: skip
        return cls(layout, [KVLayout.from_kv_caches(kv_caches, g.layer_names, num_blocks)
                            for g in layout.groups])  # fmt: skip

    @classmethod
    def single(cls, kv: KVLayout, blocks_per_chunk: int = 1) -> ChunkKV:
        """One KV cache group: every block of every layer (``KVLayout``'s own chunk layout)."""
        group = GroupLayout(0, ("*",), kv.block_bytes, 1)  # byte math needs the block only
        return cls(ChunkLayout((group,), blocks_per_chunk), [kv])

    @property
    def hybrid(self) -> bool:
        return self.layout.hybrid

    def nbytes(self, num_blocks: int) -> int:
        return self.layout.nbytes(num_blocks)

    def check(self) -> None:
        """The KV tensors hold what vLLM's KV cache spec says (else the chunk layout lies)."""
        for g, kv in zip(self.layout.groups, self.groups, strict=True):
            if kv.block_bytes != g.block_bytes:
                raise ValueError(f"kvpool: KV tensors of cache group {g.group_id} hold "
                                 f"{kv.block_bytes} bytes per block, its KV cache spec says "
                                 f"{g.block_bytes}")  # fmt: skip

    def gather(self, li: int, block_ids: SectionIds, chunk: torch.Tensor, stored: int) -> None:
        """Copy layer ``li`` of its section's blocks from the KV into the chunk buffer."""
        gi, local = self._where[li]
        ids = block_ids[gi]
        if ids:
            section = self.layout.sections(stored)[gi]
            self.groups[gi].gather(local, ids, chunk[section.offset :], section.num_blocks)

    def scatter(self, li: int, block_ids: SectionIds, chunk: torch.Tensor, stored: int,
                skip: Sequence[int]) -> None:  # fmt: skip
        """Copy layer ``li``'s section blocks ``skip[s]..`` from the chunk buffer into the KV."""
        gi, local = self._where[li]
        ids = block_ids[gi]
        if ids:
            section = self.layout.sections(stored)[gi]
            self.groups[gi].scatter(local, ids, chunk[section.offset :], section.num_blocks,
                                    skip[gi])  # fmt: skip

    def where(self, li: int) -> tuple[int, int]:
        """(group, layer index in the group's ``KVLayout``) of layer ``li``."""
        return self._where[li]

    def read_groups(self, read: ChunkRead) -> list[tuple[int, Section, int, Sequence[int]]]:
        """(group, its section of the stored chunk, skip, destination block ids) of each group a
        read puts blocks back into."""
        ids, skips = self.read_ids(read)
        return [(gi, section, skips[gi], ids[gi])
                for gi, section in enumerate(self.layout.sections(read.stored_blocks))
                if ids[gi]]  # fmt: skip

    def chunk_ops(self, block_ids: SectionIds, chunk_addr: int, to_kv: bool, stored: int,
                  skip: Sequence[int] | None = None) -> np.ndarray | None:  # fmt: skip
        """Copy rows of every section (chunk byte order); None unless all pages are CPU runs."""
        parts = []
        for gi, section in enumerate(self.layout.sections(stored)):
            if not block_ids[gi]:
                continue
            ops = self.groups[gi].chunk_ops(block_ids[gi], chunk_addr + section.offset, to_kv,
                                            section.num_blocks, skip[gi] if skip else 0)  # fmt: skip
            if ops is None:
                return None
            parts.append(ops)
        return _merge_adjacent(np.concatenate(parts)) if parts else None

    def whole(self, block_ids: SectionIds, stored: int, skip: Sequence[int]) -> bool:
        """Whether a transfer moves every stored byte of the chunk (a read may then land in the
        KV pages directly, or be verified while it is copied)."""
        return all(not s and len(ids) == sec.num_blocks for ids, s, sec
                   in zip(block_ids, skip, self.layout.sections(stored), strict=True))  # fmt: skip

    def direct_segments(self, block_ids: SectionIds, stored: int, mem_align: int,
                        align: int) -> np.ndarray | None:  # fmt: skip
        """(kv_addr, nbytes) rows an O_DIRECT read of the whole chunk can land in."""
        ops = self.chunk_ops(block_ids, 0, True, stored)
        if ops is None or len(ops) > MAX_SEGMENTS:
            return None
        dst, nbytes = ops[:, 0], ops[:, 2]
        if (dst % np.uint64(mem_align)).any() or (nbytes % np.uint64(align)).any():
            return None
        return np.ascontiguousarray(ops[:, [0, 2]])

    # -- messages -------------------------------------------------------------------------
    def save_blocks(self, job: ChunkSave) -> int:
        return job.num_blocks or len(job.block_ids)

    def save_bytes(self, job: ChunkSave) -> int:
        return self.nbytes(self.save_blocks(job))

    def save_ids(self, job: ChunkSave) -> list[tuple[int, ...]]:
        out, at = [], 0
        for section in self.layout.sections(self.save_blocks(job)):
            out.append(job.block_ids[at : at + section.num_blocks])
            at += section.num_blocks
        return out

    def read_ids(self, read: ChunkRead) -> tuple[list[tuple[int, ...]], list[int]]:
        """(destination ids per section, skip per section) of a read."""
        if not read.sections:
            return [read.block_ids], [read.skip]
        ids, skips, at = [], [], 0
        for skip, count in read.sections:
            ids.append(read.block_ids[at : at + count])
            skips.append(skip)
            at += count
        return ids, skips

    def gather_job(self, li: int, job: ChunkSave, chunk: torch.Tensor) -> None:
        self.gather(li, self.save_ids(job), chunk, self.save_blocks(job))

    def scatter_read(self, li: int, read: ChunkRead, chunk: torch.Tensor) -> None:
        ids, skips = self.read_ids(read)
        self.scatter(li, ids, chunk, read.stored_blocks, skips)

    def read_ops(self, read: ChunkRead, chunk_addr: int) -> np.ndarray | None:
        ids, skips = self.read_ids(read)
        return self.chunk_ops(ids, chunk_addr, True, read.stored_blocks, skips)

    def whole_read(self, read: ChunkRead) -> bool:
        ids, skips = self.read_ids(read)
        return self.whole(ids, read.stored_blocks, skips)

    def read_segments(self, read: ChunkRead, mem_align: int, align: int) -> np.ndarray | None:
        ids, _ = self.read_ids(read)
        return self.direct_segments(ids, read.stored_blocks, mem_align, align)
