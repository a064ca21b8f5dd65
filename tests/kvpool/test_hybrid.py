"""Hybrid attention (vLLM's hybrid KV cache manager ON): the connector against vLLM's real
Scheduler / KVCacheManager, KV grouped and allocated by vLLM's own code.

Model: 4 layers alternating sliding window (64 tokens) / full attention, 2 KV heads x head 32 x
fp32, blocks of 32 tokens (16 KiB per layer and block), chunks of 128 tokens (4 blocks). vLLM
makes 2 KV cache groups; a chunk keeps the full group's 4 blocks and the sliding group's last 2
(cdiv(64 - 1, 32)): 192 KiB per chunk, 1536 B per token instead of 2048 with HMA off.
Prefill runs 128 tokens a step, so vLLM frees (and hands out again) sliding-window blocks while
the request runs.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.vllm_harness import BLOCK_SIZE, corrupt_on_disk, make_vllm_config  # noqa: E402
from tests.kvpool.hybrid_support import HybridHarness, write_tiny_hybrid  # noqa: E402
from vllm_kvpool.handlers import LoadOp  # noqa: E402

PROMPT = [(i * 5 + 7) % 500 + 3 for i in range(640)]  # 20 blocks = 5 chunks
CHUNK_BLOCKS, PAGE = 4, 2 * 32 * (32 + 32) * 4  # 2 heads x 32 tokens x (K, V of 32 fp32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))


def build(model_dir, tmp_path, caplog) -> HybridHarness:
    tmp_path.mkdir(exist_ok=True)
    pool = {
        "chunk_tokens": CHUNK_BLOCKS * BLOCK_SIZE,
        "staging": "1MiB",
        "devices": [
            {"host": {"capacity": "1MiB", "bandwidth_gbps": 6.0}},
            {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "4MiB", "backend": "uring",
                     "bandwidth_gbps": 2.0}},
        ],
    }  # fmt: skip
    with caplog.at_level(logging.WARNING):
        cfg = make_vllm_config(model_dir, pool, max_batched_tokens=128,
                               extra={"status_file": str(tmp_path / "status.json")})  # fmt: skip
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert "hybrid kv cache manager" not in caplog.text.lower()
    h = HybridHarness.build_hybrid(cfg, num_blocks=128)
    kinds = [type(g.kv_cache_spec).__name__ for g in h.groups]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]
    return h


def read_chunk(h: HybridHarness, entry) -> torch.Tensor:
    """The bytes a committed chunk holds in the pool (host memory or SSD)."""
    loc = entry.location
    handler = h.worker.engine.tiers[loc.device]
    buf = handler.load_buffer(loc.slot, loc.nbytes)
    try:
        if not handler.resident:
            handler.wait(handler.submit_load([LoadOp(loc.slot, buf.address, loc.nbytes, None)]))
        return buf.view[: loc.nbytes].clone()
    finally:
        buf.release()


def stale_blocks(h: HybridHarness, tokens: list[int]) -> list[tuple[int, str, int]]:
    """(chunk, layer, block) of every pooled block whose bytes are not the request's KV."""
    layout = h.worker.engine.layout.layout
    first_block = {key: i for i, key in enumerate(h.hashes)}  # a chunk's key: its first block
    bad = []
    for entry in h.connector.pool.index.entries.values():
        if not entry.committed:
            continue
        c = first_block[entry.key]
        data = read_chunk(h, entry)
        for s in layout.sections(entry.location.num_blocks):
            for li, name in enumerate(s.group.layer_names):
                for j in range(s.num_blocks):
                    at = s.offset + (li * s.num_blocks + j) * PAGE
                    got = data[at : at + PAGE].view(torch.float32).view(h.kv[name][0].shape)
                    block = c + s.first + j
                    if not torch.equal(got, h.expected_layer_block(name, tokens, block)):
                        bad.append((c // CHUNK_BLOCKS, name, block))
    return bad


def save_prompt(h: HybridHarness, tokens: list[int]) -> None:
    """Run a request to the end; on the way, vLLM frees and reuses sliding-window blocks."""
    request = h.add("A", tokens)
    h.hashes = list(request.block_hashes)
    freed = reused = False
    seen: set[int] = set()
    for _ in range(50):
        if "A" in h.finished:
            break
        h.step()
        if "A" in h.finished:
            break
        swa, _full = h.group_block_ids("A")
        freed |= 0 in swa  # vLLM put the null block where out-of-window blocks were
        reused |= bool(seen & {b for b in swa if b})
        seen |= {b for b in swa[: len(swa) - 4] if b}
    assert freed and reused, "the test needs sliding-window blocks freed and reused mid-run"
    h.drain()


# B shares 18 blocks with PROMPT; the hit ends at the last chunk boundary the window is stored for
B_TOKENS = PROMPT[:600] + [(i * 3 + 1) % 500 + 3 for i in range(100)]


def run_past_hit(h: HybridHarness, req_id: str, tokens: list[int], hit_blocks: int = 16):
    """Run a request to the end; (its first ``hit_blocks`` sliding and full block ids, a copy of
    the KV) right after it computed past the hit."""
    h.add(req_id, tokens, max_tokens=2)
    snapshot = None
    for _ in range(80):
        h.step()
        running = req_id in [r.request_id for r in h.scheduler.running]
        if (snapshot is None and running
                and h.requests[req_id].num_computed_tokens >= hit_blocks * BLOCK_SIZE):  # fmt: skip
            swa, full = h.group_block_ids(req_id)
            snapshot = (swa[:hit_blocks], full[:hit_blocks],
                        {name: t.clone() for name, t in h.kv.items()})  # fmt: skip
        if req_id in h.finished:
            break
    assert snapshot is not None and req_id in h.finished
    return snapshot


def test_groups_stored_per_window_and_loaded_byte_identical(model_dir, tmp_path, caplog):
    h = build(model_dir, tmp_path, caplog)
    save_prompt(h, PROMPT + [900, 901, 902])
    pool = h.connector.pool
    committed = [e for e in pool.index.entries.values() if e.committed]
    assert len(committed) == 5
    assert stale_blocks(h, PROMPT) == []  # every group's section is exactly the request's KV

    # bytes per token: what the geometry says, written as measured by the workers
    layout = h.worker.engine.layout.layout  # the connector's, from vLLM's KV cache config
    per_token = layout.bytes_per_token(BLOCK_SIZE)
    assert per_token == (2 * 4 + 2 * 2) * PAGE / 128 == 1536
    written = sum(d.bytes_written for d in pool.transfers.devices.values())
    assert written == 5 * 128 * per_token
    hma_off = 4 * 4 * PAGE / 128  # vLLM's HMA-off grouping: every layer full attention
    assert per_token < hma_off

    probe = h.make_request("probe", B_TOKENS)
    matched, is_async = h.connector.get_num_new_matched_tokens(probe, 0)
    assert (matched, is_async) == (16 * BLOCK_SIZE, True)
    for t in h.kv.values():
        t.zero_()  # whatever B finds in its blocks came from the pool
    before = {n: (d.bytes_read, d.chunks_read) for n, d in pool.transfers.devices.items()}
    swa, full, kv = run_past_hit(h, "B", B_TOKENS)
    assert all(b == 0 for b in swa[:14]) and all(swa[14:])  # vLLM holds only the window
    for group, ids, blocks in ((h.groups[1], full, range(16)), (h.groups[0], swa, (14, 15))):
        for name in group.layer_names:
            for b in blocks:
                assert torch.equal(kv[name][ids[b]], h.expected_layer_block(name, B_TOKENS, b)), (
                    name, b)  # fmt: skip
    moved = {n: (d.bytes_read - before[n][0], d.chunks_read - before[n][1])
             for n, d in pool.transfers.devices.items()}
    # an SSD reads (and is charged) whole chunks; the host pool's copy moves only what the KV
    # takes, so its charge leaves out the earlier chunks' window tails (its learned rate)
    (ssd_bytes, ssd_chunks), (host_bytes, host_chunks) = moved["ssd0"], moved["host0"]
    assert ssd_chunks + host_chunks == 4 and host_chunks >= 2
    assert ssd_bytes == ssd_chunks * layout.chunk_bytes
    assert host_bytes < host_chunks * layout.chunk_bytes
    assert layout.fetch_bytes(16) <= ssd_bytes + host_bytes < 4 * layout.chunk_bytes


def test_freed_window_blocks_are_copied_before_vllm_reuses_them(model_dir, tmp_path, caplog,
                                                                monkeypatch):  # fmt: skip
    """Negative control first: with the copy-before-release wait switched off and the saver
    held until the request is done, the pooled sliding-window bytes are stale (vLLM reused
    those blocks). Then the real engine: the same run pools exactly the request's KV."""
    from vllm_kvpool.layout import ChunkKV

    h = build(model_dir, tmp_path / "neg", caplog)
    held = threading.Event()
    h.worker.engine.saves.thread.submit(held.wait)
    with monkeypatch.context() as m:
        m.setattr(ChunkKV, "hybrid", property(lambda self: False))
        request = h.add("A", PROMPT + [900])
        h.hashes = list(request.block_hashes)
        for _ in range(50):  # its blocks stay held (saves pending): wait for the finish only
            if "A" in h.finished:
                break
            h.step()
    held.set()
    h.drain()
    stale = stale_blocks(h, PROMPT)
    assert stale and {name for _, name, _ in stale} <= set(h.groups[0].layer_names)

    h = build(model_dir, tmp_path / "pos", caplog)
    save_prompt(h, PROMPT + [900])
    assert stale_blocks(h, PROMPT) == []


def test_corrupt_ssd_chunk_is_recomputed_not_a_crash(model_dir, tmp_path, caplog):
    """vLLM 0.32 cannot map block-level load errors back to requests when there are several KV
    cache groups (it raises); the connector reports the request as a failed receive instead,
    and vLLM recomputes it: the KV ends up right and the chunk leaves the index."""
    h = build(model_dir, tmp_path, caplog)
    save_prompt(h, PROMPT + [900, 901, 902])
    pool = h.connector.pool
    victim = next(e for e in pool.index.entries.values()
                  if e.committed and e.location.device == 1)  # fmt: skip
    corrupt_on_disk(h.worker.engine.tiers[1], victim.location.slot)
    for t in h.kv.values():
        t.zero_()
    _, full, kv = run_past_hit(h, "B", B_TOKENS)
    assert pool.transfers.devices["ssd0"].corrupt >= 1
    assert victim.dead and pool.index.get(victim.key) is not victim
    for name in h.groups[1].layer_names:  # full attention: every block recomputed or loaded
        for b in range(16):
            assert torch.equal(kv[name][full[b]], h.expected_layer_block(name, B_TOKENS, b)), (
                name, b)  # fmt: skip


def test_sync_loads_are_refused_with_several_kv_cache_groups(model_dir, tmp_path):
    from vllm_kvpool.config import PoolConfigError

    pool = {"chunk_tokens": CHUNK_BLOCKS * BLOCK_SIZE, "load_mode": "sync",
            "devices": [{"host": {"capacity": "1MiB", "bandwidth_gbps": 6.0}}]}  # fmt: skip
    cfg = make_vllm_config(model_dir, pool, max_batched_tokens=128,
                           extra={"status_file": str(tmp_path / "status.json")})  # fmt: skip
    with pytest.raises(PoolConfigError, match="load_mode") as err:
        HybridHarness.build_hybrid(cfg, num_blocks=128)
    assert err.value.field == "load_mode"
