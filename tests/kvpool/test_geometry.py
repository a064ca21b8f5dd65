"""Per-group chunk layouts from vLLM's real KV spec classes and grouping; the paper's models."""

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

from vllm_kvpool.geometry import MODELS, chunk_layout, tp_replica_shard  # noqa: E402

BS = 16


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


def test_mla_replicated_across_tp_is_written_once_per_shard():
    """vLLM marks MLA's latent cache ``max_tp_shards=1``; its own ``kv_cache_groups_tp_replicas``
    then says all TP ranks hold the same KV, and the pool writes it from one rank."""
    from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas

    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                           max_tp_shards=1)  # fmt: skip
    gqa = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["m0", "m1"], mla)]
    replicas = kv_cache_groups_tp_replicas(groups, tp_size=4)
    assert replicas == 4
    assert [tp_replica_shard(r, 4, replicas) for r in range(4)] == [
        (0, True), (0, False), (0, False), (0, False)]  # fmt: skip
    # with pipeline parallelism each stage's layers are their own shard
    assert [tp_replica_shard(r, 4, replicas) for r in (4, 5)] == [(1, True), (1, False)]
    # head-sharded GQA KV: every rank its own shard, each written
    plain = kv_cache_groups_tp_replicas([KVCacheGroupSpec(["g"], gqa)], tp_size=4)
    assert [tp_replica_shard(r, 4, plain) for r in range(4)] == [(r, True) for r in range(4)]
    layout = chunk_layout(_config(*groups), BS, 16)
    assert layout.chunk_bytes == 16 * 2 * mla.real_page_size_bytes  # latent: one vector/token


@pytest.mark.parametrize(("model", "per_token", "fetch_32k"), [
    ("llama-3.1-8b", 131072, 4 * 2**30),  # 32 layers x 8 heads x 128 x K,V x bf16
    ("qwen3-30b-a3b", 98304, 3 * 2**30),  # 48 x 4 x 128 x 2 x 2
    ("gpt-oss-20b", 36864, 12 * 2048 * (32768 + 128)),  # full every token, window 128 at the end
])  # fmt: skip
def test_paper_model_geometry(model, per_token, fetch_32k):
    geo = MODELS[model]
    assert geo.bytes_per_token(block_size=16, chunk_tokens=256) == per_token
    assert geo.fetch_bytes(32768) == fetch_32k
    if geo.sliding_layers:
        assert geo.fetch_bytes(32768, hma=False) == 24 * 2048 * 32768  # 1.5 GiB with HMA off
        assert geo.bytes_per_token(hma=False) == 49152


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
