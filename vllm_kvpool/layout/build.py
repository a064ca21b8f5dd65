"""The one factory of chunk layouts, with three front doors:

* ``from_vllm``: vLLM's ``KVCacheConfig`` (the connector, scheduler and worker alike);
* ``from_model``: a model's KV geometry as its ``config.json`` states it (benchmarks, the GPU
  kit, capacity planning);
* ``from_kv_caches``: KV tensors without a model behind them (``LocalPool``).

Each validates ``chunk_tokens`` against the block size and fingerprints what the bytes depend on
(``layout_version``), so a chunk written under another layout is never served. vLLM's spec
classes are read through duck typing: no vLLM import here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.layout.chunk import ChunkLayout, GroupLayout, cdiv


def layout_fingerprint(parts: Sequence[object]) -> int:
    """Stable 63-bit id of a KV layout (layer names, page sizes, dtypes, block size, ...)."""
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _build(config: PoolConfig, groups: Sequence[GroupLayout], block_size: int,
           identity: Iterable[object]) -> ChunkLayout:  # fmt: skip
    bpc = config.check_block_size(block_size)
    if not groups:
        raise ValueError("kvpool: the model has no KV cache group to store")
    shape = [(g.group_id, g.layer_names, g.page_bytes, g.window_blocks) for g in groups]
    layout = ChunkLayout(tuple(groups), bpc,
                         layout_fingerprint([shape, block_size, bpc, *identity]))  # fmt: skip
    layout.check_capacity(config)
    return layout


# ----------------------------------------------------------------------------- vLLM
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


def from_vllm(config: PoolConfig, kv_cache_config: Any, block_size: int,
              identity: Iterable[object] = ()) -> ChunkLayout:  # fmt: skip
    """The chunk layout of vLLM's ``KVCacheConfig``. Groups vLLM does not transfer are left out
    (``enable_kv_transfer`` False marks replicas vLLM rebuilds itself). ``identity``: what else
    the bytes depend on (the model, dtype, TP layout, block hashing: ``identity.py``)."""
    kept = [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if getattr(g, "enable_kv_transfer", True)]  # fmt: skip
    groups = [group_layout(i, g, block_size) for i, g in kept]
    dtypes = [(str(g.kv_cache_spec.dtype), type(g.kv_cache_spec).__name__) for _, g in kept]
    layout = _build(config, groups, block_size, [dtypes, *identity])
    return layout.with_replicated(all(kind.startswith("MLA") for _, kind in dtypes))


# ----------------------------------------------------------------------------- a model
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

    def groups(self, block_size: int, hma: bool = True) -> list[GroupLayout]:
        """With ``hma`` the sliding layers form a sliding-window group; without it vLLM treats
        every layer as full attention (one group)."""
        page = self.layer_bytes_per_token * block_size
        full = self.num_layers - (self.sliding_layers if hma else 0)
        out = [GroupLayout(0, tuple(f"full.{i}" for i in range(full)), page, block_size)]
        if hma and self.sliding_layers:
            assert self.sliding_window is not None
            out.append(GroupLayout(1, tuple(f"swa.{i}" for i in range(self.sliding_layers)),
                                   page, block_size, cdiv(self.sliding_window - 1, block_size),
                                   self.sliding_window))  # fmt: skip
        return out


def from_model(config: PoolConfig, model: ModelGeometry, block_size: int,
               hma: bool = True) -> ChunkLayout:  # fmt: skip
    """What the pool stores per chunk of ``model`` under ``config``'s chunk size."""
    return _build(config, model.groups(block_size, hma), block_size, [model.name])


# ----------------------------------------------------------------------------- KV tensors
def from_kv_caches(config: PoolConfig, kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                   block_size: int, identity: Iterable[object] = ()) -> ChunkLayout:  # fmt: skip
    """Every layer full attention, one block table; layers of one page size form a group (a
    group's layers share a page size, as in vLLM)."""
    by_page: dict[int, list[str]] = {}
    for name, t in kv_caches.items():
        if t.shape[0] % num_blocks:
            raise ValueError(f"kvpool: KV tensor of {name} has {t.shape[0]} blocks, not a "
                             f"multiple of the {num_blocks} blocks given")  # fmt: skip
        by_page.setdefault(t[0].numel() * t.element_size() * (t.shape[0] // num_blocks),
                           []).append(name)  # fmt: skip
    groups = [GroupLayout(i, tuple(names), page, block_size)
              for i, (page, names) in enumerate(by_page.items())]  # fmt: skip
    dtypes = [str(t.dtype) for t in kv_caches.values()]
    return _build(config, groups, block_size, [dtypes, *identity])
