"""GroupKV's copy plans: the merged whole-chunk rows move the same bytes as the per-layer path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.layout import GroupKV  # noqa: E402
from vllm_kvpool.native import kvio  # noqa: E402

BLOCKS, HEADS, BLOCK_TOKENS, HEAD2 = 16, 2, 4, 8


def make_layout(seed: int, uniform: bool) -> GroupKV:
    """Three layers; non-uniform ones differ in KV heads (the per-layer copy plan)."""
    g = torch.Generator().manual_seed(seed)
    kv = {f"layer.{i}": torch.randn(BLOCKS, HEADS + (0 if uniform else i), BLOCK_TOKENS, HEAD2,
                                    generator=g) for i in range(3)}  # fmt: skip
    return GroupKV.from_kv_caches(kv, list(kv), BLOCKS)


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(("stored", "skip", "block_ids"),
                         [(4, 0, [9, 3, 4, 5]), (4, 1, [7, 8]), (3, 0, [2, 11])])  # fmt: skip
def test_chunk_ops_scatter_equals_per_layer_scatter(stored, skip, block_ids, uniform):
    src = make_layout(0, uniform)
    chunk = torch.empty(stored * src.block_bytes, dtype=torch.uint8)
    for li in range(len(src.layers)):
        src.gather(li, list(range(stored)), chunk, stored)

    per_layer, merged = make_layout(1, uniform), make_layout(1, uniform)
    for li in range(len(per_layer.layers)):
        per_layer.scatter(li, block_ids, chunk, stored, skip)
    ops = merged.chunk_ops(block_ids, chunk.data_ptr(), True, stored, skip)
    assert ops is not None and len(ops) <= len(block_ids) * len(merged.layers)
    kvio().copy_many(ops, threads=2)
    # Gathering the same blocks back through the plan reproduces the chunk's bytes.
    back = torch.zeros_like(chunk)
    gather = merged.chunk_ops(block_ids, back.data_ptr(), False, stored, skip)
    kvio().copy_many(gather, threads=1)

    for a, b, s in zip(per_layer.layers, merged.layers, src.layers, strict=True):
        assert torch.equal(a.tensor, b.tensor)
        want = s.tensor[skip : skip + len(block_ids)]
        assert torch.equal(b.tensor[block_ids], want)
    for li, layer in enumerate(src.layers):
        lo = src.offset(li, stored) + skip * layer.page_bytes
        hi = lo + len(block_ids) * layer.page_bytes
        assert torch.equal(back[lo:hi], chunk[lo:hi])


def test_chunk_ops_needs_contiguous_cpu_pages():
    kv = {"l": torch.randn(BLOCKS, BLOCK_TOKENS, HEADS, HEAD2).transpose(1, 2)}  # HND view
    layout = GroupKV.from_kv_caches(kv, ["l"], BLOCKS)
    assert layout.chunk_ops([0, 1], 0, True) is None
