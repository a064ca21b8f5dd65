"""What a chunk holds per KV cache group (vLLM's hybrid KV cache manager), and the KV geometry of
the paper's models. Pure logic: no I/O, vLLM's spec classes only read through duck typing.

A chunk is ``blocks_per_chunk`` consecutive token blocks of one request, keyed by the block-hash
chain. With the hybrid manager (HMA) vLLM splits the layers into KV cache groups, each with its
own block table. A chunk stores one *section* per group, group-major, full-attention groups
first (``[group][layer][block][page]``):

* a full-attention group (``FullAttentionSpec``, ``MLAAttentionSpec``) keeps every block;
* a sliding-window group (``SlidingWindowSpec``) keeps only the chunk's last ``window_blocks``
  blocks, ``window_blocks = cdiv(sliding_window - 1, block_size)``: what the window needs when a
  later request's hit ends at this chunk (vLLM's ``SlidingWindowManager`` asks the same number of
  contiguous blocks for a local prefix-cache hit). Any chunk end can be a hit position, so every
  chunk keeps its tail; a load puts sliding-window blocks back only for the window at the hit
  position, not for every matched chunk.

A hit may only end where every sliding-window group has its window: at the end of a stored
chunk (a match that stops inside a chunk falls back to the previous chunk's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

GroupKind = Literal["full", "sliding_window"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """Byte layout of a chunk: one section per group, full-attention groups first."""

    groups: tuple[GroupLayout, ...]
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        order = sorted(self.groups, key=lambda g: (g.window_blocks is not None, g.group_id))
        object.__setattr__(self, "groups", tuple(order))

    @property
    def hybrid(self) -> bool:
        return any(g.window_blocks is not None for g in self.groups)

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


# ----------------------------------------------------------------------------- from vLLM
def group_layout(group_id: int, group: Any, block_size: int) -> GroupLayout:
    """A ``GroupLayout`` from a vLLM ``KVCacheGroupSpec`` (its spec class decides the kind)."""
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    window, tokens = None, 0
    if hasattr(spec, "sliding_window") and kind.startswith("SlidingWindow"):
        tokens = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
        window = cdiv(spec.sliding_window - 1, block_size)
    elif not hasattr(spec, "num_kv_heads") or kind in ("ChunkedLocalAttentionSpec",
                                                       "CrossAttentionSpec"):  # fmt: skip
        raise ValueError(f"kvpool: KV cache group {group_id} ({kind}) is not an attention KV "
                         "the pool can store (full attention, MLA or sliding window)")  # fmt: skip
    if spec.block_size != block_size:
        raise ValueError(f"kvpool: KV cache group {group_id} has block_size {spec.block_size}, "
                         f"the pool's chunks use {block_size}")  # fmt: skip
    page = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    return GroupLayout(group_id, tuple(group.layer_names), page, block_size, window, tokens)


def chunk_layout(kv_cache_config: Any, block_size: int, blocks_per_chunk: int) -> ChunkLayout:
    """The chunk layout of vLLM's ``KVCacheConfig`` (groups vLLM does not transfer are left
    out: ``enable_kv_transfer`` False marks replicas vLLM rebuilds itself)."""
    groups = [group_layout(i, g, block_size)
              for i, g in enumerate(kv_cache_config.kv_cache_groups)
              if getattr(g, "enable_kv_transfer", True)]  # fmt: skip
    if not groups:
        raise ValueError("kvpool: the model has no KV cache group to store")
    return ChunkLayout(tuple(groups), blocks_per_chunk)


def tp_replica_shard(rank: int, tp_size: int, replicas: int) -> tuple[int, bool]:
    """(shard this worker holds, whether it writes it). vLLM's ``kv_tp_replicas`` consecutive
    TP ranks hold identical KV (MLA's latent cache, ``max_tp_shards=1``): the chunk is stored
    once per shard, by the first rank of each replica set, not once per rank."""
    replicas = max(1, replicas)
    pp, tp = divmod(rank, tp_size)
    return pp * (tp_size // replicas) + tp // replicas, tp % replicas == 0


# ----------------------------------------------------------------------------- paper models
@dataclass(frozen=True)
class ModelGeometry:
    """KV geometry of a model, as its public ``config.json`` states it."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int | None  # tokens; layers marked "sliding_attention" in layer_types
    sliding_layers: int  # how many of ``num_layers`` use the window
    source: str  # the config.json it was checked against

    @property
    def layer_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    def page_bytes(self, block_size: int) -> int:
        return self.layer_bytes_per_token * block_size

    def chunk_layout(self, block_size: int, chunk_tokens: int, hma: bool = True) -> ChunkLayout:
        """What the pool stores per chunk: with ``hma`` the sliding layers form a sliding-window
        group; without it vLLM treats every layer as full attention (one group)."""
        bpc = chunk_tokens // block_size
        page = self.page_bytes(block_size)
        full = self.num_layers - (self.sliding_layers if hma else 0)
        groups = [GroupLayout(0, tuple(f"full.{i}" for i in range(full)), page, block_size)]
        if hma and self.sliding_layers:
            assert self.sliding_window is not None
            groups.append(GroupLayout(1, tuple(f"swa.{i}" for i in range(self.sliding_layers)),
                                      page, block_size, cdiv(self.sliding_window - 1, block_size),
                                      self.sliding_window))  # fmt: skip
        return ChunkLayout(tuple(groups), bpc)

    def bytes_per_token(self, block_size: int = 16, chunk_tokens: int = 256,
                        hma: bool = True) -> float:  # fmt: skip
        return self.chunk_layout(block_size, chunk_tokens, hma).bytes_per_token(block_size)

    def fetch_bytes(self, prefix_tokens: int, block_size: int = 16, hma: bool = True) -> int:
        """Bytes a hit on a ``prefix_tokens`` prefix puts back into vLLM's KV."""
        layout = self.chunk_layout(block_size, block_size, hma)
        return layout.fetch_bytes(prefix_tokens // block_size)


# Each checked against the model's config.json (num_hidden_layers, num_key_value_heads, head_dim
# or hidden_size / num_attention_heads, torch_dtype, sliding_window, layer_types).
MODELS: dict[str, ModelGeometry] = {
    "llama-3.1-8b": ModelGeometry(
        "meta-llama/Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
        sliding_window=None, sliding_layers=0,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "gpt-oss-20b": ModelGeometry(
        "openai/gpt-oss-20b", num_layers=24, num_kv_heads=8, head_dim=64, dtype_bytes=2,
        sliding_window=128, sliding_layers=12,  # layer_types: sliding, full, sliding, ...
        source="https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json"),
    "qwen3-30b-a3b": ModelGeometry(
        "Qwen/Qwen3-30B-A3B", num_layers=48, num_kv_heads=4, head_dim=128, dtype_bytes=2,
        sliding_window=None, sliding_layers=0,  # use_sliding_window: false
        source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
}  # fmt: skip
