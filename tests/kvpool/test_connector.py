"""The connector against vLLM's real Scheduler / KVCacheManager and vLLM-made KV views (CPU).

Shapes: 2 layers x 2 KV heads x head 32 x fp32, block 32 tokens -> 32 KiB per block, chunks of
64 tokens (2 blocks, 64 KiB). Devices: a host pool and two file-backed SSDs (uring, O_DIRECT).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.model import write_tiny_llama  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    BLOCK_SIZE,
    Harness,
    corrupt_on_disk,
    make_vllm_config,
    ssd_writes_held,
)

PROMPT = list(range(3, 3 + 640))  # 20 blocks = 10 chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def pool_cfg(tmp_path, load_mode="async", host="512KiB", ssd="4MiB", backend="uring",
             save_decode=True):  # fmt: skip
    return {
        "chunk_tokens": 64,
        "save_decode": save_decode,
        "load_mode": load_mode,
        "staging": "1MiB",
        "devices": [
            {"host": {"capacity": host, "bandwidth_gbps": 6.0}},
            {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": ssd, "backend": backend,
                     "bandwidth_gbps": 2.0}},
            {"ssd": {"path": str(tmp_path / "ssd1.bin"), "capacity": ssd, "backend": backend,
                     "bandwidth_gbps": 2.0}},
        ],
    }  # fmt: skip


def build(model_dir, tmp_path, layout="LBHNC", page_aligned=False, **kw) -> Harness:
    cfg = make_vllm_config(model_dir, pool_cfg(tmp_path, **kw),
                           extra={"status_file": str(tmp_path / "status.json")})  # fmt: skip
    return Harness.build(cfg, num_blocks=128, layout=layout, page_aligned=page_aligned)


def reads_land_in_kv(h: Harness, block_ids: list[int]) -> bool:
    """Whether a full-chunk SSD read into these blocks skips the staging copy."""
    dev = h.worker.engine.tiers[1].device
    return h.worker.engine.layout.direct_segments([block_ids], len(block_ids), dev.mem_alignment,
                                                  dev.alignment) is not None  # fmt: skip


def save_first_request(h: Harness) -> None:
    h.add("A", PROMPT + [900, 901, 902])
    h.run(["A"])
    h.drain()


def run_and_capture(h: Harness, req_id: str, tokens: list[int], n_blocks: int):
    """Run a request to the end. Returns (its first n_blocks right after the pool load, the
    same blocks when it finished)."""
    h.add(req_id, tokens, max_tokens=2)
    snapshot, ids = None, None
    for _ in range(100):
        h.step()
        req = h.requests[req_id]
        running = req_id in [r.request_id for r in h.scheduler.running]
        if running:
            ids = h.block_ids(req_id)[:n_blocks]
        if snapshot is None and running and req.num_computed_tokens >= n_blocks * BLOCK_SIZE:
            snapshot = {name: t[ids].clone() for name, t in h.kv.items()}
        if req_id in h.finished:
            break
    assert snapshot is not None and req_id in h.finished
    return snapshot, {name: t[ids].clone() for name, t in h.kv.items()}


def expected(h: Harness, tokens: list[int], n_blocks: int) -> dict:
    per_block = [h.expected_block(tokens, b) for b in range(n_blocks)]
    return {name: torch.stack([pb[name] for pb in per_block]) for name in h.kv}


@pytest.mark.parametrize(("load_mode", "layout", "page_aligned"),
                         [("async", "LBHNC", False), ("sync", "BLHNC", False),
                          ("async", "LBHNC", True)])  # fmt: skip
def test_saved_prefix_is_served_byte_identical(model_dir, tmp_path, load_mode, layout,
                                               page_aligned):  # fmt: skip
    h = build(model_dir, tmp_path, load_mode=load_mode, layout=layout, page_aligned=page_aligned)
    # page-aligned CPU KV: SSD chunks are read straight into the KV pages, else via staging
    assert reads_land_in_kv(h, list(range(4))) == page_aligned
    save_first_request(h)
    pool = h.connector.pool
    committed = [e for e in pool.index.entries.values() if e.committed]
    assert len(committed) == 10  # every prompt chunk saved
    # striped in bandwidth proportion 6:2:2
    assert Counter(e.location.device for e in committed) == {0: 6, 1: 2, 2: 2}

    b_tokens = PROMPT[:600] + list(range(2000, 2100))  # shares 18 full blocks with A
    probe = Harness.make_request("probe", b_tokens)
    matched, is_async = h.connector.get_num_new_matched_tokens(probe, 0)
    assert matched == 18 * BLOCK_SIZE and is_async == (load_mode == "async")
    got, _ = run_and_capture(h, "B", b_tokens, 18)
    want = expected(h, b_tokens, 18)
    for name in h.kv:
        assert torch.equal(got[name], want[name]), name
    assert pool.lookups.hit_tokens >= 18 * BLOCK_SIZE
    per_dev = pool.transfers.devices
    assert per_dev["ssd0"].bytes_read > 0 and per_dev["ssd1"].bytes_read > 0
    assert per_dev["host0"].bytes_read > 0  # all three devices served the prefix


def test_sleep_mode_unregister_drains_background_copies(model_dir, tmp_path):
    h = build(model_dir, tmp_path)
    engine = h.worker.engine
    held = threading.Event()
    engine.saves.thread.submit(held.wait)  # hold the save thread so the step's copies stay queued
    h.add("A", PROMPT + [900])
    h.step()
    # A finished with its saves queued: the engine keeps its blocks until they are written
    sending, _, _ = engine.take_finished(["A"])
    assert "A" not in sending and not engine.take_report().committed
    threading.Timer(0.2, held.set).start()
    h.worker.unregister_kv_caches()  # vLLM >= 0.33 calls this before unmapping the KV
    sending, _, _ = engine.take_finished([])
    assert sending == {"A"}  # every save written by the time it returns
    assert len(engine.take_report().committed) == 10  # the prompt's chunks


def test_prompt_after_a_finished_one_is_served_its_late_saves(model_dir, tmp_path):
    """A's SSD writes complete only after A finished, and before B arrives. Their commits
    reach the scheduler with a step's worker report, which vLLM applies after that step's
    lookups: B's lookup must wait for them rather than stop at A's first SSD chunk."""
    h = build(model_dir, tmp_path)
    h.add("A", PROMPT + [900, 901, 902])
    with ssd_writes_held(h.worker.engine):
        for _ in range(10):
            h.step()
            if "A" in h.finished:
                break
    assert "A" in h.finished
    h.worker.engine.wait_all()  # every save of A written (not yet reported)
    pool = h.connector.pool
    assert len([e for e in pool.index.entries.values() if e.committed]) < 10
    hits = pool.lookups.hit_tokens
    got, _ = run_and_capture(h, "B", PROMPT + [5, 6], 20)
    assert pool.lookups.hit_tokens - hits == 20 * BLOCK_SIZE  # all 10 chunks from the pool
    want = expected(h, PROMPT, 20)
    for name in h.kv:
        assert torch.equal(got[name], want[name]), name


def test_wait_for_a_save_that_never_settles_is_bounded(model_dir, tmp_path):
    """A chunk reserved for a save that never reports (a stuck writer): a request whose
    prefix runs into it is held ``save_wait_seconds``, then recomputes from there."""
    pool_dict = {**pool_cfg(tmp_path), "save_wait_seconds": 0.3}
    h = Harness.build(make_vllm_config(model_dir, pool_dict), num_blocks=128)
    save_first_request(h)
    pool = h.connector.pool
    hashes = h.requests["A"].block_hashes
    stuck = pool.index.get(hashes[8])  # chunk 4: blocks 8-9
    pool.invalidate(stuck.key)
    assert pool.plan_saves("ghost", [(8, hashes[8:10])])  # reserved; no worker writes it
    hits = pool.lookups.hit_tokens
    start = time.monotonic()
    h.add("B", PROMPT + [5, 6], max_tokens=2)
    h.step()
    assert h.requests["B"].num_computed_tokens == 0  # held, not scheduled
    while "B" not in h.finished and time.monotonic() - start < 60:  # idle steps are fast
        h.step()
    assert "B" in h.finished and time.monotonic() - start >= 0.3
    assert pool.lookups.hit_tokens - hits == 8 * BLOCK_SIZE  # chunks 0-3; the rest recomputed


@pytest.mark.parametrize("save_decode", [True, False])
def test_generated_tokens_are_saved_for_the_next_turn(model_dir, tmp_path, save_decode):
    h = build(model_dir, tmp_path, save_decode=save_decode)
    h.add("A", PROMPT[:608], max_tokens=100)  # 19 prompt blocks: chunk 9 starts as 1 block
    while h.requests["A"].num_computed_tokens < 608:
        h.step()
    # Real decode steps take milliseconds: the partial chunk's write commits long before the
    # generated tokens fill it (until then its replacement is retried, step after step).
    h.worker.engine.wait_all()
    h.run(["A"])
    h.drain()
    # A's KV covers the prompt and 99 generated tokens: 707 tokens, 22 full blocks, 11 chunks
    next_turn = list(h.requests["A"].all_token_ids) + list(range(3000, 3040))
    matched, _ = h.connector.get_num_new_matched_tokens(Harness.make_request("p", next_turn), 0)
    if not save_decode:  # only the prompt: its 18 full blocks and the partial chunk's one
        assert matched == 19 * BLOCK_SIZE
        return
    assert matched == 22 * BLOCK_SIZE
    entries = [e for e in h.connector.pool.index.entries.values() if e.committed]
    assert len(entries) == 11 and all(len(e.block_hashes) == 2 for e in entries)  # 9 replaced
    got, _ = run_and_capture(h, "B", next_turn, 22)
    want = expected(h, next_turn, 22)
    for name in h.kv:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("page_aligned", [False, True])
def test_corrupt_chunk_is_a_miss_and_recomputed(model_dir, tmp_path, page_aligned):
    h = build(model_dir, tmp_path, page_aligned=page_aligned)
    assert reads_land_in_kv(h, list(range(4))) == page_aligned
    save_first_request(h)
    pool = h.connector.pool
    victim = next(e for e in pool.index.entries.values() if e.location.device == 1)
    corrupt_on_disk(h.worker.engine.tiers[1], victim.location.slot)
    _, final = run_and_capture(h, "B", PROMPT + [5, 6], 20)
    assert victim.dead and pool.index.get(victim.key) is not victim  # dropped from the index
    assert pool.transfers.devices["ssd0"].corrupt >= 1
    assert pool.lookups.invalidated >= 1
    want = expected(h, PROMPT, 20)  # vLLM recomputed the bad blocks: the KV is right
    for name in h.kv:
        assert torch.equal(final[name], want[name]), name
    h.drain()  # ...and B saved the recomputed chunk again, a fresh entry
    fresh = pool.index.get(victim.key)
    assert fresh is not None and fresh.committed and fresh is not victim


def test_failed_device_turns_into_misses_engine_keeps_serving(model_dir, tmp_path):
    h = build(model_dir, tmp_path)
    save_first_request(h)
    h.worker.engine.tiers[2].device.close()  # the device "disappears"
    got, _ = run_and_capture(h, "B", PROMPT + [5, 6], 2)
    pool = h.connector.pool
    assert pool.weights.failed[2]
    assert all(e.location.device != 2 for e in pool.index.entries.values())
    for name in h.kv:
        assert torch.equal(got[name], expected(h, PROMPT, 2)[name])
    # new prompts are still saved, on the healthy devices only
    other = list(range(5000, 5000 + 320))
    h.add("C", other)
    h.run(["C"])
    h.drain()
    new = [e for e in pool.index.entries.values() if e.block_hashes[0] in
           set(h.requests["C"].block_hashes)]  # fmt: skip
    assert new and all(e.location.device in (0, 1) for e in new)


def test_full_pool_evicts_instead_of_failing(model_dir, tmp_path):
    h = build(model_dir, tmp_path, host="128KiB", ssd="128KiB")  # 2 slots per device
    for i in range(4):
        h.add(f"R{i}", list(range(10000 * (i + 1), 10000 * (i + 1) + 256)))
        h.run([f"R{i}"])
        h.drain()
    pool = h.connector.pool
    assert pool.lookups.evictions > 0
    assert sum(u.used_slots for u in pool.status().usage) == 6
    last = h.requests["R3"]
    hits = pool.match(last.block_hashes)
    assert sum(x.num_blocks for x in hits) == 8  # the newest prompt is fully in the pool


def test_stats_hook_and_status_file(model_dir, tmp_path):
    from vllm_kvpool.metrics import PoolStatus

    h = build(model_dir, tmp_path)
    save_first_request(h)
    run_and_capture(h, "B", PROMPT + [5], 4)
    h.drain()
    assert h.kv_stats  # vLLM's scheduler collected our stats into its SchedulerStats
    cls = type(h.connector)
    stats = cls.build_kv_connector_stats(h.kv_stats[0])
    for data in h.kv_stats[1:]:
        stats = stats.aggregate(cls.build_kv_connector_stats(data))
    summary = stats.reduce()
    assert summary["hit_rate"] > 0.4
    assert any(k.startswith("read_GBps:") for k in summary)
    h.connector.scheduler.write_status()
    status = PoolStatus.read(tmp_path / "status.json")
    assert status.lookups.hit_tokens == h.connector.pool.lookups.hit_tokens
    assert {u.name for u in status.usage} == {"host0", "ssd0", "ssd1"}
    # Each device's probe figure rides along as a gauge: the latest value, never summed over
    # the intervals aggregated above.
    assert {k: v for k, v in summary.items() if k.startswith("probe_GBps:")} == {
        f"probe_GBps:{u.name}": round(u.probe_gbps, 2) for u in status.usage}, len(h.kv_stats)


def test_background_migration_moves_chunks_off_a_slowed_device(model_dir, tmp_path):
    """With ``migration`` on, once a device's share time exceeds the others' (its reads measured
    slow), the scheduler plans moves in the step metadata, the worker copies them in the
    background and the chunks are served byte-identical from their new devices."""
    cfg = make_vllm_config(model_dir, {**pool_cfg(tmp_path, host="2MiB"),
                                       "migration": {"enabled": True, "every": 0.001,
                                                     "bandwidth": "64MiB"}})  # fmt: skip
    h = Harness.build(cfg, num_blocks=128)
    save_first_request(h)
    pool = h.connector.pool
    slow = 2
    before = sum(e.location.device == slow for e in pool.index.entries.values())
    assert before
    pool.weights.observe(slow, "read", 10**9, 10.0)  # measured at 0.1 GB/s (prior 2.0)
    pool.weights.observe(slow, "read", 10**9, 10.0)
    assert not pool.plan_moves()  # the guard has not kept a split with less on it yet
    pool.weights.guard.reset(pool.weights.estimates())  # as once a fetch measured it no slower
    for _ in range(20):  # idle steps: plans go down, copies come back in the reports
        h.step()
        h.worker.engine.wait_moves()
        if not pool.moves and pool.lookups.moves_done:
            break
    after = sum(e.location.device == slow for e in pool.index.entries.values())
    assert pool.lookups.moves_done == before - after > 0 and pool.lookups.moves_failed == 0
    got, _ = run_and_capture(h, "B", PROMPT + [5, 6], 20)
    for name in h.kv:
        assert torch.equal(got[name], expected(h, PROMPT, 20)[name])
