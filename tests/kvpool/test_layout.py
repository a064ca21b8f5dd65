"""GroupKV's copy plans: the merged whole-chunk rows move the same bytes as the per-layer path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.layout import GroupKV  # noqa: E402
from vllm_kvpool.native import kvio  # noqa: E402

BLOCKS, HEADS, BLOCK_TOKENS, HEAD2 = 16, 2, 4, 8


def make_layout(seed: int, uniform: bool, name: str = "layer") -> GroupKV:
    """Three layers; non-uniform ones differ in KV heads (the per-layer copy plan)."""
    g = torch.Generator().manual_seed(seed)
    kv = {f"{name}.{i}": torch.randn(BLOCKS, HEADS + (0 if uniform else i), BLOCK_TOKENS, HEAD2,
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


def _at_once_and_one_by_one(bound, jobs):
    """Two fresh KVs (``bound(1)``): one filled by ``reads_ops`` of all ``jobs`` at once, the
    other by each job's own ``read_ops`` in turn."""
    at_once, one_by_one = bound(1), bound(1)
    ops = at_once.reads_ops(jobs)
    assert ops is not None
    kvio().copy_many(ops, threads=2)
    for read, addr in jobs:
        kvio().copy_many(one_by_one.read_ops(read, addr), threads=1)
    return at_once, one_by_one


@pytest.mark.parametrize("uniform", [True, False])
def test_reads_ops_of_many_chunks_move_what_each_chunks_rows_move(uniform):
    """A wave's or a host share's rows planned at once (``ChunkKV.reads_ops``) put every chunk in
    the same KV pages as each chunk's own ``read_ops``, mixed with partial reads too."""
    from vllm_kvpool.layout import ChunkKV, ChunkLayout, GroupLayout
    from vllm_kvpool.protocol import ChunkRead

    def bound(seed: int) -> ChunkKV:
        group = make_layout(seed, uniform)
        layout = ChunkLayout((GroupLayout(0, tuple(f"layer.{i}" for i in range(3)),
                                          group.block_bytes, BLOCK_TOKENS),), 2)  # fmt: skip
        return ChunkKV(layout, [group])

    stored, rng = 2, torch.Generator().manual_seed(5)
    src = bound(0)
    chunks = torch.randint(0, 256, (4, stored * src.groups[0].block_bytes), dtype=torch.uint8,
                           generator=rng)  # fmt: skip
    whole = [((3, 4), ((0, 2),)), ((9, 0), ((0, 2),)), ((15, 7), ((0, 2),)), ((1, 2), ((0, 2),))]
    for reads in (whole, [*whole[:2], ((11,), ((1, 1),)), whole[3]]):
        jobs = [(ChunkRead(b"k", 0, 0, stored, {}, ids, sections), chunks[i].data_ptr())
                for i, (ids, sections) in enumerate(reads)]  # fmt: skip
        at_once, one_by_one = _at_once_and_one_by_one(bound, jobs)
        for a, b in zip(at_once.groups[0].layers, one_by_one.groups[0].layers, strict=True):
            assert torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))  # NaNs
        untouched = bound(1).groups[0].layers[0].tensor.view(torch.uint8)
        assert not torch.equal(at_once.groups[0].layers[0].tensor.view(torch.uint8), untouched)


@pytest.mark.parametrize("uniform", [True, False])
def test_reads_ops_of_hybrid_reads_move_what_each_reads_rows_move(uniform):
    """With a sliding-window group, reads of several shapes at once (tails dropped, a window
    block skipped, a shorter chunk, whole chunks) put every section's blocks where each read's
    own ``read_ops`` puts them, and nothing else (planned per shape and section)."""
    from vllm_kvpool.layout import ChunkKV, ChunkLayout, GroupLayout
    from vllm_kvpool.protocol import ChunkRead

    def bound(seed: int) -> ChunkKV:
        full, swa = make_layout(seed, uniform), make_layout(seed + 100, uniform, "swa")
        groups = (GroupLayout(0, tuple(x.name for x in full.layers), full.block_bytes, 4),
                  GroupLayout(1, tuple(x.name for x in swa.layers), swa.block_bytes, 4, 2, 8))
        return ChunkKV(ChunkLayout(groups, 4), [full, swa])  # fmt: skip

    src = bound(0)
    rng = torch.Generator().manual_seed(3)
    chunks = torch.randint(0, 256, (6, src.nbytes(4)), dtype=torch.uint8, generator=rng)
    reads = [((0, 1, 2, 3), 4, ((0, 4), (0, 0))), ((4, 5, 6, 7), 4, ((0, 4), (0, 0))),
             ((8, 9, 10, 11, 10, 11), 4, ((0, 4), (0, 2))),  # whole
             ((12, 13), 4, ((2, 2), (0, 0))),  # blocks vLLM already holds skipped
             ((14, 15, 12, 13, 15), 4, ((0, 4), (1, 1))),
             ((14,), 1, ((0, 1), (0, 0)))]  # a shorter chunk  # fmt: skip
    jobs = [(ChunkRead(b"k", 0, 0, stored, {}, ids, sections), chunks[i].data_ptr())
            for i, (ids, stored, sections) in enumerate(reads)]  # fmt: skip
    at_once, one_by_one = _at_once_and_one_by_one(bound, jobs)
    for a, b, c in zip(at_once.layers, one_by_one.layers, bound(1).layers, strict=True):
        assert torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)), a.name
        assert not torch.equal(a.tensor.view(torch.uint8), c.tensor.view(torch.uint8)), a.name
