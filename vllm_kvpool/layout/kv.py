"""A chunk layout bound to vLLM's KV tensors (worker side): where a chunk's bytes live in the
paged KV and in pool memory.

``ChunkKV`` is a ``ChunkLayout`` over the tensors: one ``GroupKV`` per KV cache group moves that
group's section of the chunk. A section holds its blocks of every layer of the group,
layer-major: ``[layer][block][page bytes]`` where a page is the block's bytes of that layer in
vLLM's logical ``[H, N, C]`` order. Layer-major lets a layer of many blocks be
gathered/scattered in one ``index_select``/``index_copy_`` straight between KV tensor and pool
memory, whatever physical ``KVCacheLayout`` vLLM chose. On CPU the copies are planned as
``(dst, src, nbytes)`` rows (``chunk_ops``) that the C++ engine runs GIL-free (``copy_many``).

With the hybrid KV cache manager every group has its own block table (groups alias one KV
buffer, a block id being owned by one group at a time), so a message's ``block_ids`` are the
sections' ids one section after the other: a save's are the stored blocks of each section
(``ChunkSave.num_blocks`` says the chunk's length), a read's ``ChunkRead.sections`` say
``(skip, count)`` per section.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_kvpool.layout.chunk import ChunkLayout, Section
from vllm_kvpool.native import kvio
from vllm_kvpool.protocol import ChunkRead, ChunkSave

COPY_THREADS = 2  # GIL-free memcpy threads per gather/scatter (C++ copy_many)
MAX_SEGMENTS = 4096  # host segments of one direct read (one backend request each)


@dataclass(frozen=True)
class LayerPages:
    name: str
    tensor: torch.Tensor  # vLLM's per-layer view, logical [kernel_blocks, H, N, C]
    ratio: int  # kernel blocks per vLLM block (vLLM may split a block for the kernel)
    page_bytes: int  # bytes of one vLLM block of this layer


@dataclass
class GroupKV:
    """One KV cache group's pages in vLLM's tensors."""

    layers: list[LayerPages]
    layer_prefix: list[int] = field(default_factory=list)  # page bytes of the layers before

    def __post_init__(self) -> None:
        acc = 0
        self.layer_prefix = []
        for layer in self.layers:
            self.layer_prefix.append(acc)
            acc += layer.page_bytes
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._plan = self._uniform_plan()

    def _uniform_plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int] | None:
        """(KV base, KV page stride, page bytes before the layer, ratio, kernel page bytes), when
        all layers have contiguous CPU pages of one size: ``chunk_ops`` is then one numpy
        expression instead of a loop over layers (it runs once per chunk, holding the GIL)."""
        if not self.layers:
            return None
        first = self.layers[0]
        for layer in self.layers:
            if (not _contiguous_pages(layer) or layer.ratio != first.ratio
                    or layer.page_bytes != first.page_bytes):  # fmt: skip
                return None
        base = np.array([layer.tensor.data_ptr() for layer in self.layers], dtype=np.uint64)
        stride = np.array([layer.tensor.stride(0) * layer.tensor.element_size()
                           for layer in self.layers], dtype=np.uint64)  # fmt: skip
        prefix = np.array(self.layer_prefix, dtype=np.uint64)
        return base, stride, prefix, first.ratio, first.page_bytes // first.ratio

    @property
    def block_bytes(self) -> int:
        return sum(layer.page_bytes for layer in self.layers)

    @classmethod
    def from_kv_caches(
        cls, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int
    ) -> GroupKV:
        """Learn vLLM's real per-layer KV views (as ``register_kv_caches`` hands them over)."""
        layers = []
        for name in layer_names:
            t = kv_caches[name]
            if t.shape[0] % num_blocks:
                raise ValueError(f"kvpool: KV tensor of {name} has {t.shape[0]} blocks, not a "
                                 f"multiple of the {num_blocks} blocks vLLM allocated")  # fmt: skip
            ratio = t.shape[0] // num_blocks
            page = t[0].numel() * t.element_size() * ratio
            layers.append(LayerPages(name, t, ratio, page))
        return cls(layers)

    def offset(self, layer: int, num_blocks: int) -> int:
        """Byte offset of ``layer`` inside a chunk of ``num_blocks`` blocks."""
        return num_blocks * self.layer_prefix[layer]

    def _ids(self, layer: LayerPages, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        if layer.ratio > 1:
            ids = (ids[:, None] * layer.ratio + torch.arange(layer.ratio)).reshape(-1)
        return ids.to(layer.tensor.device, non_blocking=True)

    def _host_view(self, buf: torch.Tensor, layer: LayerPages, n: int) -> torch.Tensor:
        t = layer.tensor
        return buf[: n * layer.page_bytes].view(t.dtype).view(n * layer.ratio, *t.shape[1:])

    def _page_ops(self, layer: LayerPages, block_ids: Sequence[int], chunk_addr: int,
                  to_kv: bool) -> np.ndarray | None:  # fmt: skip
        """(dst, src, nbytes) rows, one per kernel page; None unless ``_contiguous_pages``."""
        if not _contiguous_pages(layer):
            return None
        t = layer.tensor
        return _copy_rows(np.array([t.data_ptr()], dtype=np.uint64),
                          np.array([t.stride(0) * t.element_size()], dtype=np.uint64),
                          np.array([chunk_addr], dtype=np.uint64), layer.ratio,
                          layer.page_bytes // layer.ratio, block_ids, to_kv)  # fmt: skip

    def chunk_ops(self, block_ids: Sequence[int], chunk_addr: int, to_kv: bool,
                  stored: int | None = None, skip: int = 0) -> np.ndarray | None:  # fmt: skip
        """Copy rows for chunk blocks ``skip..skip+len(block_ids)`` of a chunk of ``stored``
        blocks (every layer, in chunk byte order), adjacent pages merged; None unless every
        layer's pages are contiguous CPU memory (see ``_page_ops``)."""
        stored = len(block_ids) if stored is None else stored
        if self._plan is not None:
            base, stride, prefix, ratio, kpage = self._plan
            host = np.uint64(chunk_addr + skip * ratio * kpage) + prefix * np.uint64(stored)
            return _merge_adjacent(_copy_rows(base, stride, host, ratio, kpage, block_ids, to_kv))
        parts = []
        for li, layer in enumerate(self.layers):
            addr = chunk_addr + self.offset(li, stored) + skip * layer.page_bytes
            ops = self._page_ops(layer, block_ids, addr, to_kv)
            if ops is None:
                return None
            parts.append(ops)
        return _merge_adjacent(np.concatenate(parts)) if parts else None

    def chunks_ops(self, block_ids: np.ndarray, chunk_addrs: np.ndarray, stored: int,
                   skip: int = 0) -> np.ndarray | None:  # fmt: skip
        """Rows putting many chunks' sections of this group back into the KV: chunk ``c``'s
        section (``stored`` blocks) starts at ``chunk_addrs[c]`` and its blocks
        ``skip..skip+k`` go to ``block_ids[c]`` (one row of ``k`` ids per chunk). One numpy
        expression for all of them, the rows of the chunks' ``chunk_ops`` (their order aside);
        None without the uniform plan."""
        if self._plan is None:
            return None
        base, stride, prefix, ratio, kpage = self._plan
        n = len(block_ids)
        kernel = (block_ids.astype(np.uint64)[:, :, None] * np.uint64(ratio)
                  + np.arange(ratio, dtype=np.uint64)).reshape(n, -1)  # fmt: skip
        layer_start = prefix * np.uint64(stored) + np.uint64(skip * ratio * kpage)
        ops = np.empty((n, len(base), kernel.shape[1], 3), dtype=np.uint64)
        ops[..., 0] = base[None, :, None] + kernel[:, None, :] * stride[None, :, None]
        ops[..., 1] = (chunk_addrs.astype(np.uint64)[:, None, None] + layer_start[None, :, None]
                       + np.arange(kernel.shape[1], dtype=np.uint64)[None, None, :]
                       * np.uint64(kpage))  # fmt: skip
        ops[..., 2] = kpage
        return _merge_adjacent(ops.reshape(-1, 3))

    def gather(self, li: int, block_ids: Sequence[int], chunk: torch.Tensor, stored: int) -> None:
        """Copy layer ``li`` of ``block_ids`` from the KV tensor into the chunk buffer."""
        layer = self.layers[li]
        n = len(block_ids)
        region = chunk[self.offset(li, stored) :]
        ops = self._page_ops(layer, block_ids, region.data_ptr(), to_kv=False)
        if ops is not None:
            kvio().copy_many(ops, threads=COPY_THREADS)
            return
        dst = self._host_view(region, layer, n)
        ids = self._ids(layer, block_ids)
        if layer.tensor.device.type == "cpu":
            torch.index_select(layer.tensor, 0, ids, out=dst)
        else:
            dst.copy_(layer.tensor.index_select(0, ids))

    def scatter(self, li: int, block_ids: Sequence[int], chunk: torch.Tensor, stored: int,
                skip: int = 0) -> None:  # fmt: skip
        """Copy chunk blocks ``skip..skip+len(block_ids)`` of layer ``li`` into the KV."""
        layer = self.layers[li]
        region = chunk[self.offset(li, stored) + skip * layer.page_bytes :]
        ops = self._page_ops(layer, block_ids, region.data_ptr(), to_kv=True)
        if ops is not None:
            kvio().copy_many(ops, threads=COPY_THREADS)
            return
        src = self._host_view(region, layer, len(block_ids))
        ids = self._ids(layer, block_ids)
        layer.tensor.index_copy_(0, ids, src.to(layer.tensor.device, non_blocking=True))


SectionIds = Sequence[Sequence[int]]  # block ids per section, in the layout's section order


class ChunkKV:
    """A ``ChunkLayout`` bound to the KV tensors: one ``GroupKV`` per KV cache group."""

    def __init__(self, layout: ChunkLayout, groups: list[GroupKV]) -> None:
        self.layout = layout
        self.groups = groups
        self.layers: list[LayerPages] = [layer for g in groups for layer in g.layers]
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._where = [(gi, li) for gi, g in enumerate(groups) for li in range(len(g.layers))]

    @classmethod
    def from_kv_caches(cls, kv_caches: dict[str, torch.Tensor], layout: ChunkLayout,
                       num_blocks: int) -> ChunkKV:  # fmt: skip
        """Learn vLLM's real per-layer KV views (as ``register_kv_caches`` hands them over) and
        check they hold what the layout says (else the chunk layout lies)."""
        kv = cls(layout, [GroupKV.from_kv_caches(kv_caches, g.layer_names, num_blocks)
                          for g in layout.groups])  # fmt: skip
        for g, group in zip(layout.groups, kv.groups, strict=True):
            if group.block_bytes != g.block_bytes:
                raise ValueError(f"kvpool: KV tensors of cache group {g.group_id} hold "
                                 f"{group.block_bytes} bytes per block, its KV cache spec says "
                                 f"{g.block_bytes}")  # fmt: skip
        return kv

    @property
    def hybrid(self) -> bool:
        return self.layout.hybrid

    @property
    def device(self) -> torch.device:
        return self.layers[0].tensor.device if self.layers else torch.device("cpu")

    def nbytes(self, num_blocks: int) -> int:
        return self.layout.nbytes(num_blocks)

    def where(self, li: int) -> tuple[int, int]:
        """(group, layer index in the group's ``GroupKV``) of layer ``li``."""
        return self._where[li]

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
        """(kv_addr, nbytes) rows that let an O_DIRECT read of the whole chunk land straight in
        the KV pages (no staging copy): only when the pages are CPU memory aligned for the
        device."""
        ops = self.chunk_ops(block_ids, 0, True, stored)
        if ops is None or len(ops) > MAX_SEGMENTS:
            return None
        dst, nbytes = ops[:, 0], ops[:, 2]
        if (dst % np.uint64(mem_align)).any() or (nbytes % np.uint64(align)).any():
            return None
        return np.ascontiguousarray(ops[:, [0, 2]])

    # -- messages -------------------------------------------------------------------------
    def save_bytes(self, job: ChunkSave) -> int:
        return self.nbytes(job.num_blocks)

    def save_ids(self, job: ChunkSave) -> list[tuple[int, ...]]:
        out, at = [], 0
        for section in self.layout.sections(job.num_blocks):
            out.append(job.block_ids[at : at + section.num_blocks])
            at += section.num_blocks
        return out

    def read_ids(self, read: ChunkRead) -> tuple[list[tuple[int, ...]], list[int]]:
        """(destination ids per section, skip per section) of a read."""
        ids, skips, at = [], [], 0
        for skip, count in read.sections:
            ids.append(read.block_ids[at : at + count])
            skips.append(skip)
            at += count
        return ids, skips

    def gather_job(self, li: int, job: ChunkSave, chunk: torch.Tensor) -> None:
        self.gather(li, self.save_ids(job), chunk, job.num_blocks)

    def scatter_read(self, li: int, read: ChunkRead, chunk: torch.Tensor) -> None:
        ids, skips = self.read_ids(read)
        self.scatter(li, ids, chunk, read.stored_blocks, skips)

    def read_ops(self, read: ChunkRead, chunk_addr: int) -> np.ndarray | None:
        ids, skips = self.read_ids(read)
        return self.chunk_ops(ids, chunk_addr, True, read.stored_blocks, skips)

    def reads_ops(self, reads: Sequence[tuple[ChunkRead, int]]) -> np.ndarray | None:
        """The copy rows of many ``(read, chunk address)`` at once: the rows of each one's
        ``read_ops``, not in that order (callers only copy them); None when any has none. Reads
        of one shape (stored blocks and ``(skip, count)`` per section: a fetch's host share or
        wave is mostly full chunks, or with HMA chunks that drop their sliding-window tails) are
        planned one numpy pass per section for all of them (~100 chunks, where a pass per chunk
        cost ~0.1 ms each, holding the GIL, before the copy could start)."""
        if not reads:
            return None
        shapes: dict[tuple[int, tuple[tuple[int, int], ...]], list[tuple[ChunkRead, int]]] = {}
        for r, a in reads:
            shapes.setdefault((r.stored_blocks, tuple(map(tuple, r.sections))), []).append((r, a))
        parts = []
        for (stored, sections), same in shapes.items():
            ops = self._same_shape_ops(same, stored, sections)
            if ops is None:  # a group without the uniform plan: chunk by chunk
                ops = [self.read_ops(r, a) for r, a in same]
            if any(o is None for o in ops):
                return None
            parts.extend(ops)
        return np.concatenate(parts)

    def _same_shape_ops(self, reads: Sequence[tuple[ChunkRead, int]], stored: int,
                        sections: Sequence[tuple[int, int]]) -> list[np.ndarray] | None:  # fmt: skip
        """``reads_ops`` of reads of one shape: one ``GroupKV.chunks_ops`` per section read."""
        ids = np.array([r.block_ids for r, _ in reads], dtype=np.uint64).reshape(len(reads), -1)
        addrs = np.array([a for _, a in reads], dtype=np.uint64)
        out, at = [], 0
        for gi, (section, (skip, count)) in enumerate(zip(self.layout.sections(stored), sections,
                                                            strict=True)):  # fmt: skip
            if not count:
                continue
            ops = self.groups[gi].chunks_ops(ids[:, at : at + count],
                                             addrs + np.uint64(section.offset),
                                             section.num_blocks, skip)  # fmt: skip
            if ops is None:
                return None
            out.append(ops)
            at += count
        return out

    def read_bytes(self, read: ChunkRead) -> int:
        """Bytes ``read`` puts into the KV: each section's blocks read, its skipped ones and
        the sliding-window tails it drops not counted."""
        return sum(count * s.group.block_bytes for s, (_, count)
                   in zip(self.layout.sections(read.stored_blocks), read.sections, strict=True))

    def whole_read(self, read: ChunkRead) -> bool:
        ids, skips = self.read_ids(read)
        return self.whole(ids, read.stored_blocks, skips)

    def read_segments(self, read: ChunkRead, mem_align: int, align: int) -> np.ndarray | None:
        ids, _ = self.read_ids(read)
        return self.direct_segments(ids, read.stored_blocks, mem_align, align)


def _contiguous_pages(layer: LayerPages) -> bool:
    """Whether each kernel page ([H, N, C]) is one run of CPU memory (LBHNC, BLHNC, ...)."""
    t = layer.tensor
    return t.device.type == "cpu" and t[0].is_contiguous()


def _copy_rows(kv_base: np.ndarray, kv_stride: np.ndarray, host_base: np.ndarray, ratio: int,
               kpage: int, block_ids: Sequence[int], to_kv: bool) -> np.ndarray:  # fmt: skip
    """(dst, src, nbytes) rows, one per kernel page, layer by layer: layer l's KV pages start at
    ``kv_base[l]``, ``kv_stride[l]`` bytes apart; its run in the chunk starts at ``host_base[l]``."""
    ids = np.asarray(block_ids, dtype=np.uint64)[:, None] * np.uint64(ratio)
    kernel = (ids + np.arange(ratio, dtype=np.uint64)).reshape(-1)
    kv = (kv_base[:, None] + kernel[None, :] * kv_stride[:, None]).ravel()
    host = (host_base[:, None]
            + np.arange(kernel.size, dtype=np.uint64)[None, :] * np.uint64(kpage)).ravel()  # fmt: skip
    ops = np.empty((kv.size, 3), dtype=np.uint64)
    ops[:, 0], ops[:, 1] = (kv, host) if to_kv else (host, kv)
    ops[:, 2] = kpage
    return ops


def _merge_adjacent(ops: np.ndarray) -> np.ndarray:
    """Merge consecutive (dst, src, nbytes) rows that continue each other in both buffers."""
    if len(ops) < 2:
        return ops
    ends_dst = ops[:-1, 0] + ops[:-1, 2]
    ends_src = ops[:-1, 1] + ops[:-1, 2]
    starts = np.flatnonzero(np.concatenate(
        ([True], (ops[1:, 0] != ends_dst) | (ops[1:, 1] != ends_src))))  # fmt: skip
    merged = ops[starts].copy()
    merged[:, 2] = np.add.reduceat(ops[:, 2], starts)
    return merged
