"""Chunk layouts from vLLM's real KV spec classes and grouping (``layout.build.from_vllm``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.layout import ChunkLayout  # noqa: E402
from vllm_kvpool.layout import build as layouts  # noqa: E402

BS = 16


def chunk_layout(kv_cache_config: KVCacheConfig, block_size: int,
                 blocks_per_chunk: int) -> ChunkLayout:  # fmt: skip
    config = load_pool_config({"chunk_tokens": blocks_per_chunk * block_size,
                               "devices": [{"host": {"capacity": "64GiB"}}]})  # fmt: skip
    return layouts.from_vllm(config, kv_cache_config, block_size)


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _gpt_oss_like(window: int = 128) -> KVCacheConfig:
    common = dict(block_size=BS, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(sliding_window=window, **common)
    return _config(KVCacheGroupSpec([f"l{i}" for i in range(0, 24, 2)], swa),
                   KVCacheGroupSpec([f"l{i}" for i in range(1, 24, 2)], FullAttentionSpec(**common)))  # fmt: skip


def test_sliding_group_keeps_only_the_window_tail_full_group_every_block():
    layout = chunk_layout(_gpt_oss_like(), BS, blocks_per_chunk=16)
    full, swa = layout.groups  # full attention first, whatever vLLM's group order
    assert (full.kind, full.group_id, swa.kind, swa.group_id) == ("full", 1, "sliding_window", 0)
    assert swa.window_blocks == 8  # cdiv(128 - 1, 16)
    page = 16 * 2 * 8 * 64 * 2
    sections = layout.sections(16)
    assert [(s.first, s.num_blocks, s.offset) for s in sections] == [
        (0, 16, 0), (8, 8, 16 * 12 * page)]  # fmt: skip
    assert layout.chunk_bytes == (16 + 8) * 12 * page
    # a short (partial) chunk keeps all its sliding blocks while they are fewer than the window
    assert [(s.first, s.num_blocks) for s in layout.sections(5)] == [(0, 5), (0, 5)]


def test_loads_put_back_the_window_only_at_the_hit_position():
    layout = chunk_layout(_gpt_oss_like(), BS, blocks_per_chunk=16)
    hit_end = 48  # three full chunks
    by_chunk = [layout.loads(first, 16, 0, hit_end) for first in (0, 16, 32)]
    assert [[(s.group.kind, lo, hi) for s, lo, hi in loads] for loads in by_chunk] == [
        [("full", 0, 16)], [("full", 16, 32)], [("full", 32, 48), ("sliding_window", 40, 48)]]
    # a local prefix-cache hit up to block 44: only what vLLM does not hold yet
    assert [(s.group.kind, lo, hi) for s, lo, hi in layout.loads(32, 16, 44, hit_end)] == [
        ("full", 44, 48), ("sliding_window", 44, 48)]  # fmt: skip
    # a window longer than a chunk takes the tails of the chunks before it as well
    wide = chunk_layout(_gpt_oss_like(window=300), BS, blocks_per_chunk=8)
    got = [(s.group.kind, lo, hi) for first in (0, 8, 16) for s, lo, hi in wide.loads(first, 8, 0, 24)]
    assert ("sliding_window", 5, 8) in got and ("sliding_window", 8, 16) in got
    assert layout.fetch_bytes(48) == (48 + 8) * 12 * layout.groups[0].page_bytes


def test_a_match_must_end_where_the_window_is_stored():
    hybrid = chunk_layout(_gpt_oss_like(), BS, blocks_per_chunk=16)
    plain = chunk_layout(_config(KVCacheGroupSpec(["a"], FullAttentionSpec(
        block_size=BS, num_kv_heads=8, head_size=64, dtype=torch.bfloat16))), BS, 16)  # fmt: skip
    diverged = [(0, 16, 16), (16, 16, 10)]  # the prefix diverges inside the second chunk
    assert plain.usable_hit_blocks(diverged) == 26
    assert hybrid.usable_hit_blocks(diverged) == 16
    partial_prompt = [(0, 16, 16), (16, 5, 5)]  # the prompt's stored partial last chunk
    assert hybrid.usable_hit_blocks(partial_prompt) == 21


def test_vllm_grouping_with_hma_off_stores_more_than_with_hma_on():
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs

    common = dict(block_size=BS, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    specs = {f"l{i}": SlidingWindowSpec(sliding_window=128, **common) if i % 2 == 0
             else FullAttentionSpec(**common) for i in range(24)}  # fmt: skip
    unify_hybrid_kv_cache_specs(specs)  # what vLLM does with the hybrid manager off
    off = chunk_layout(_config(KVCacheGroupSpec(list(specs), specs["l0"])), BS, 16)
    on = chunk_layout(_gpt_oss_like(), BS, 16)
    assert not off.hybrid and on.hybrid
    assert off.bytes_per_token(BS) == 24 * 2048 and on.bytes_per_token(BS) == 12 * 2048 * 1.5
    assert on.fetch_bytes(2048) < off.fetch_bytes(2048) / 1.9


def test_unsupported_group_kind_is_named():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8,
                                     dtype=torch.float16, attention_chunk_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="group 0 .ChunkedLocalAttentionSpec"):
        chunk_layout(_config(KVCacheGroupSpec(["x"], spec)), BS, 4)


def test_mla_latent_cache_is_one_vector_per_token():
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                           max_tp_shards=1)  # fmt: skip
    layout = chunk_layout(_config(KVCacheGroupSpec(["m0", "m1"], mla)), BS, 16)
    assert layout.num_groups == 1 and not layout.hybrid
    assert layout.chunk_bytes == 16 * 2 * mla.real_page_size_bytes


def test_layout_version_names_what_the_bytes_depend_on():
    """Another dtype, grouping or identity (model, TP layout) is another layout: never served."""
    common = dict(block_size=BS, num_kv_heads=8, head_size=64)
    one = _config(KVCacheGroupSpec(["a", "b"], FullAttentionSpec(dtype=torch.bfloat16, **common)))
    config = load_pool_config({"chunk_tokens": 256, "devices": [{"host": {"capacity": "1GiB"}}]})
    base = layouts.from_vllm(config, one, BS, ["model-a"])
    assert layouts.from_vllm(config, one, BS, ["model-a"]).layout_version == base.layout_version
    other_dtype = _config(KVCacheGroupSpec(["a", "b"], FullAttentionSpec(dtype=torch.float16,
                                                                         **common)))  # fmt: skip
    versions = {layouts.from_vllm(config, one, BS, ["model-b"]).layout_version,
                layouts.from_vllm(config, other_dtype, BS, ["model-a"]).layout_version,
                layouts.from_vllm(config, _gpt_oss_like(), BS, ["model-a"]).layout_version}
    assert base.layout_version not in versions and len(versions) == 3


def test_first_kept_block_follows_vllms_sliding_window_manager():
    """The scheduler never plans a copy of a block vLLM already freed: ``first_kept`` is the
    block count vLLM's own ``SlidingWindowManager.get_num_skipped_tokens`` frees."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    swa, full = chunk_layout(_gpt_oss_like(), BS, blocks_per_chunk=16).groups[::-1]
    manager = SimpleNamespace(sliding_window=128, extra_retained_tokens=0)
    for computed in (0, 100, 127, 128, 129, 143, 144, 1000, 4096):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, computed)
        assert swa.first_kept(computed) == skipped // BS, computed
        assert full.first_kept(computed) == 0
