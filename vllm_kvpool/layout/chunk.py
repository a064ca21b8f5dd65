"""The one chunk shape: what a chunk holds per KV cache group, its bytes and its pool slot.

A chunk is ``blocks_per_chunk`` consecutive token blocks of one request, keyed by the block-hash
chain. vLLM puts the layers into KV cache groups, each with its own block table (one group
unless the hybrid manager, HMA, splits them). A chunk stores one *section* per group,
group-major, full-attention groups first (``[group][layer][block][page]``); a model without
HMA is simply a layout with one group:

* a full-attention group (``FullAttentionSpec``, ``MLAAttentionSpec``) keeps every block;
* a sliding-window group (``SlidingWindowSpec``) keeps only the chunk's last ``window_blocks``
  blocks, ``window_blocks = cdiv(sliding_window - 1, block_size)``: what the window needs when a
  later request's hit ends at this chunk (vLLM's ``SlidingWindowManager`` asks the same number of
  contiguous blocks for a local prefix-cache hit). Any chunk end can be a hit position, so every
  chunk keeps its tail; a load puts sliding-window blocks back only for the window at the hit
  position, not for every matched chunk.

A hit may only end where every sliding-window group has its window: at the end of a stored
chunk (a match that stops inside a chunk falls back to the previous chunk's end).

Every pool device is cut into ``slot_bytes`` slots (one chunk each, aligned for O_DIRECT), the
same on the scheduler and on each worker, so a (device, slot) pair is a complete address.
Pure logic: no I/O, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from vllm_kvpool.config import SLOT_ALIGNMENT  # a device smaller than one slot is refused there

if TYPE_CHECKING:
    from vllm_kvpool.config import DeviceConfig, PoolConfig

GroupKind = Literal["full", "sliding_window"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_up(n: int, alignment: int) -> int:
    return cdiv(n, alignment) * alignment


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group as the pool stores it."""

    group_id: int  # index in vLLM's ``KVCacheConfig.kv_cache_groups``
    layer_names: tuple[str, ...]
    page_bytes: int  # one block of one layer (vLLM's unpadded page)
    block_size: int  # tokens per block
    window_blocks: int | None = None  # sliding window: blocks it needs at a hit position
    sliding_window: int = 0  # tokens (0: full attention)

    @property
    def kind(self) -> GroupKind:
        return "full" if self.window_blocks is None else "sliding_window"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the group's layers."""
        return self.page_bytes * len(self.layer_names)

    def stored(self, num_blocks: int) -> tuple[int, int]:
        """``[lo, hi)``: offsets (in the chunk) of the blocks kept of a chunk of ``num_blocks``."""
        if self.window_blocks is None:
            return 0, num_blocks
        return max(0, num_blocks - self.window_blocks), num_blocks

    def first_kept(self, num_computed_tokens: int) -> int:
        """First block vLLM still holds once ``num_computed_tokens`` are computed: its
        ``SlidingWindowManager`` frees the blocks wholly before the window (every block stays
        for full attention)."""
        if self.window_blocks is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def window(self, hit_end: int) -> tuple[int, int]:
        """``[lo, hi)``: request blocks attention needs to go on after ``hit_end`` blocks."""
        if self.window_blocks is None:
            return 0, hit_end
        return max(0, hit_end - self.window_blocks), hit_end


@dataclass(frozen=True)
class Section:
    group: GroupLayout
    first: int  # offset in the chunk of the section's first block
    num_blocks: int
    offset: int  # byte offset of the section in the chunk

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.group.block_bytes


@dataclass(frozen=True)
class ChunkLayout:
    """Byte layout of a chunk: one section per group, full-attention groups first.

    ``layout_version`` fingerprints everything the bytes depend on (``layout.build``): SSD
    index records carry it, so a chunk of another layout is never served."""

    groups: tuple[GroupLayout, ...]
    blocks_per_chunk: int
    layout_version: int = 0
    # Every tensor-parallel rank holds the same KV (MLA's latent cache is not split over heads):
    # one copy serves every rank when the ranks share the pool's memory (``pools.shards``).
    replicated: bool = False

    def __post_init__(self) -> None:
        if not self.groups or self.blocks_per_chunk < 1:
            raise ValueError(f"kvpool: a chunk layout needs a KV cache group and a block per "
                             f"chunk, got {len(self.groups)} groups, {self.blocks_per_chunk} "
                             "blocks")  # fmt: skip
        order = sorted(self.groups, key=lambda g: (g.window_blocks is not None, g.group_id))
        object.__setattr__(self, "groups", tuple(order))

    @classmethod
    def uniform(cls, block_bytes: int, blocks_per_chunk: int,
                layout_version: int = 0) -> ChunkLayout:  # fmt: skip
        """Chunks of ``blocks_per_chunk`` blocks of ``block_bytes`` each, no model behind them
        (device probes, ``kvpool probe``)."""
        return cls((GroupLayout(0, ("*",), block_bytes, 1),), blocks_per_chunk, layout_version)

    def with_replicated(self, replicated: bool) -> ChunkLayout:
        return replace(self, replicated=replicated)

    @property
    def hybrid(self) -> bool:
        """Some group keeps only a sliding window of each chunk."""
        return any(g.window_blocks is not None for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_group_tables(self) -> int:
        """Block tables a request has: vLLM's group ids run from 0."""
        return max(g.group_id for g in self.groups) + 1

    def sections(self, num_blocks: int) -> list[Section]:
        """The sections of a chunk of ``num_blocks`` blocks (the last chunk may be shorter)."""
        out, offset = [], 0
        for g in self.groups:
            lo, hi = g.stored(num_blocks)
            out.append(Section(g, lo, hi - lo, offset))
            offset += (hi - lo) * g.block_bytes
        return out

    def nbytes(self, num_blocks: int) -> int:
        """Stored bytes of a chunk of ``num_blocks`` blocks."""
        return sum(s.nbytes for s in self.sections(num_blocks))

    @property
    def chunk_bytes(self) -> int:
        return self.nbytes(self.blocks_per_chunk)

    @property
    def slot_bytes(self) -> int:
        return align_up(self.chunk_bytes, SLOT_ALIGNMENT)

    def num_slots(self, device: DeviceConfig) -> int:
        return device.capacity // self.slot_bytes

    def check_capacity(self, config: PoolConfig) -> None:
        from vllm_kvpool.config import PoolConfigError

        for i, d in enumerate(config.devices):
            if self.num_slots(d) < 1:
                raise PoolConfigError(
                    f"devices[{i}].{d.kind}.capacity",
                    f"{d.capacity} bytes holds no chunk of {self.slot_bytes} bytes "
                    f"({config.chunk_tokens} tokens)",
                )

    def bytes_per_token(self, block_size: int) -> float:
        """Stored bytes per token of a full chunk."""
        return self.chunk_bytes / (self.blocks_per_chunk * block_size)

    def fetch_bytes(self, hit_blocks: int) -> int:
        """Bytes a hit of ``hit_blocks`` blocks puts back into vLLM's KV: every block of the
        full-attention groups, the window at the hit position of the sliding-window ones."""
        return sum((hi - lo) * g.block_bytes for g in self.groups
                   for lo, hi in [g.window(hit_blocks)])  # fmt: skip

    def usable_hit_blocks(self, hits: Sequence[tuple[int, int, int]]) -> int:
        """Blocks of a prefix match a load may cover. ``hits``: ``(first_block, stored_blocks,
        matched_blocks)`` per matched chunk, in order. Without sliding-window groups every
        matched block; with them the match must end at the end of a stored chunk."""
        total = 0
        for first, stored, matched in hits:
            if matched < stored and self.hybrid:
                break  # the stored tail is not the window at this position
            total = first + matched
            if matched < stored:
                break
        return total

    def loads(self, first: int, num_blocks: int, load_from: int,
              hit_end: int) -> list[tuple[Section, int, int]]:  # fmt: skip
        """What to put back from a stored chunk starting at request block ``first`` with
        ``num_blocks`` blocks, for a hit ending at block ``hit_end`` whose blocks before
        ``load_from`` are already in vLLM's KV: ``(section, lo, hi)`` request-block ranges."""
        out = []
        for s in self.sections(num_blocks):
            want_lo, want_hi = s.group.window(hit_end)
            lo = max(first + s.first, want_lo, load_from)
            hi = min(first + s.first + s.num_blocks, want_hi)
            if lo < hi:
                out.append((s, lo, hi))
        return out


