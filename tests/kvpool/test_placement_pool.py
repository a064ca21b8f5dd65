"""Pure logic: placement math, index prefix matching, LRU eviction, device failure."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kvpool.placement_oracle import fetch_seconds
from vllm_kvpool.config import parse_pool_config
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.placement import DeviceWeights, Placement, interleave, largest_remainder
from vllm_kvpool.pool import UnifiedPool


def test_largest_remainder_is_proportional():
    assert largest_remainder(10, [3.0, 1.0, 1.0], [100, 100, 100]) == [6, 2, 2]
    assert largest_remainder(7, [1.0, 1.0], [100, 100]) in ([4, 3], [3, 4])
    # a capped device gets its cap, the rest is re-split by weight
    assert largest_remainder(10, [8.0, 1.0, 1.0], [2, 100, 100]) == [2, 4, 4]
    assert largest_remainder(10, [1.0, 0.0], [100, 100]) == [10, 0]
    assert largest_remainder(10, [1.0, 1.0], [3, 2]) == [3, 2]  # all full: fewer than asked


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.lists(st.floats(0.1, 30), min_size=1, max_size=6),
       st.data())  # fmt: skip
def test_largest_remainder_properties(total, weights, data):
    caps = data.draw(st.lists(st.integers(0, 200), min_size=len(weights), max_size=len(weights)))
    shares = largest_remainder(total, weights, caps)
    assert sum(shares) == min(total, sum(caps))
    assert all(0 <= s <= c for s, c in zip(shares, caps, strict=True))
    if sum(caps) >= total and all(c >= total for c in caps):  # uncapped: within 1 of ideal
        wsum = sum(weights)
        assert all(abs(s - total * w / wsum) < 1 + 1e-9 for s, w in zip(shares, weights, strict=True))


def test_interleave_spreads_devices():
    order = interleave([4, 2, 2])
    assert Counter(order) == {0: 4, 1: 2, 2: 2}
    assert order[:4].count(0) == 2  # any prefix is striped too


def test_stripe_continues_proportionally_across_steps():
    p = Placement("bandwidth", 3)
    weights, free = [12.0, 3.0, 3.0], [1000, 1000, 1000]
    devices = []
    for _ in range(6):  # chunked prefill: 3 chunks per step
        devices += p.assign("r", 3, weights, free)
    assert Counter(devices) == {0: 12, 1: 3, 2: 3}


def test_round_robin_and_serial_policies():
    assert Counter(Placement("round_robin", 2).assign("r", 6, [10.0, 1.0], [9, 9])) == {0: 3, 1: 3}
    serial = Placement("single_tier_serial", 2).assign("r", 6, [10.0, 1.0], [4, 9])
    assert serial == [0, 0, 0, 0, 1, 1]


def test_bandwidth_placement_equalises_fetch_time():
    weights = [10.0, 2.5, 2.5]
    counts = Counter(Placement("bandwidth", 3).assign("r", 60, weights, [100] * 3))
    chunk = 1 << 20
    t_bw = fetch_seconds([counts[d] * chunk for d in range(3)], weights)
    t_rr = fetch_seconds([20 * chunk] * 3, weights)
    assert t_bw == pytest.approx(60 * chunk / sum(weights) / 1e9, rel=1e-6)
    assert t_bw < t_rr


def test_weights_learn_from_reads_only_and_relearn_after_a_failure():
    w = DeviceWeights([10.0, 2.0], learn_after=10**9)
    assert not w.observe(1, "read", 5 * 10**8, 0.125)  # half of learn_after: not measured yet,
    # the probe's figure counts for the half not seen (5e8 bytes at 2 GB/s beside 5e8 at 4)
    assert w.gbps == [10.0, pytest.approx(1e9 / (0.125 + 0.25) / 1e9)]
    assert w.reads[1].measured_gbps is None
    assert w.observe(1, "read", 5 * 10**8, 0.125)  # enough moved: measured 4 GB/s replaces it
    assert not w.observe(0, "write", 4 * 10**9, 1.0)  # writes are shown, never the weight
    assert w.gbps == [10.0, pytest.approx(4.0)] and w.writes[0].gbps == pytest.approx(4.0)
    w.fail(0)
    assert not w.observe(0, "read", 4 * 10**9, 100.0)  # a failing device's timings: ignored
    assert w.estimates() == [0.0, pytest.approx(4.0)]
    assert w.for_placement() == [0.0, 2.0] and w.kept_shares() == [0.0, 1.0]  # never placed on
    w.fail(1)
    w.restore(1)  # back: its measurement starts again from the probe's figure
    assert w.estimates() == [0.0, 2.0]


def _pool(capacities=("1MiB", "1MiB"), placement="bandwidth", gbps=(1.0, 1.0), bpc=2):
    cfg = parse_pool_config({"devices": [{"host": {"capacity": c, "name": f"h{i}"}}
                                         for i, c in enumerate(capacities)],
                             "chunk_tokens": 32 * bpc, "placement": placement})  # fmt: skip
    geo = ChunkLayout.uniform(64 * 1024, bpc, layout_version=7)
    return UnifiedPool(cfg, geo, DeviceWeights(list(gbps)))


def _hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def _save_all(pool, req, hashes, rank=0):
    bpc = pool.layout.blocks_per_chunk
    chunks = [(i, hashes[i : i + bpc]) for i in range(0, len(hashes), bpc)]
    planned = pool.plan_saves(req, chunks)
    for p in planned:
        pool.acknowledge_save(p.entry.key, rank, 1234)
    return planned


def test_prefix_match_shares_chunks_and_partial_chunks():
    pool = _pool()
    a = _hashes("a", 6)
    _save_all(pool, "A", a)
    assert sum(h.num_blocks for h in pool.match(a)) == 6
    # b shares 3 blocks: chunk 0 fully, chunk 1 only its first block
    b = a[:3] + _hashes("b", 3)
    hits = pool.match(b)
    assert [(h.first_block, h.num_blocks) for h in hits] == [(0, 2), (2, 1)]
    assert pool.match(_hashes("c", 4)) == []


def test_uncommitted_and_wrong_layout_are_misses():
    pool = _pool()
    a = _hashes("a", 4)
    planned = pool.plan_saves("A", [(0, a[:2]), (2, a[2:])])
    assert pool.match(a) == []  # written but not acknowledged: invisible
    pool.acknowledge_save(planned[0].entry.key, 0, 1)
    assert sum(h.num_blocks for h in pool.match(a)) == 2
    pool.layout = ChunkLayout.uniform(64 * 1024, 2, layout_version=8)
    assert pool.match(a) == []


def test_lookup_says_where_a_chunk_being_written_would_take_the_prefix():
    pool = _pool()
    a = _hashes("a", 6)
    planned = pool.plan_saves("A", [(0, a[:2]), (2, a[2:4]), (4, a[4:])])
    assert pool.lookup_pending(a) == ([], 2)  # chunk 0 is being written
    pool.acknowledge_save(planned[0].entry.key, 0, 1)
    hits, pending = pool.lookup_pending(a)
    assert [(h.first_block, h.num_blocks) for h in hits] == [(0, 2)] and pending == 4
    # a request sharing one block of chunk 1 would get that block once it commits
    assert pool.lookup_pending(a[:3] + _hashes("b", 3))[1] == 3
    pool.acknowledge_save(planned[2].entry.key, 0, 1)  # chunk 2 done, chunk 1 still not
    assert pool.lookup_pending(a)[1] == 4
    pool.invalidate(planned[1].entry.key)  # chunk 1's write failed: nothing to wait for
    assert pool.lookup_pending(a)[1] == 0
    assert pool.lookup_pending(a[:1] + _hashes("c", 5))[1] == 0  # diverged inside chunk 0


def test_full_pool_evicts_lru_never_pinned():
    pool = _pool(capacities=("256KiB", "256KiB"))  # 2 slots of 128 KiB each
    old, mid = _hashes("old", 4), _hashes("mid", 4)
    _save_all(pool, "old", old)
    _save_all(pool, "mid", mid)
    assert pool.status().usage[0].used_slots + pool.status().usage[1].used_slots == 4
    pinned = [h.entry for h in pool.match(old)]
    pool.pin(pinned)  # "old" is being read: "mid" must go even though "old" is older
    new = _hashes("new", 4)
    assert len(_save_all(pool, "new", new)) == 2
    assert pool.lookups.evictions == 2
    assert sum(h.num_blocks for h in pool.match(old)) == 4
    assert pool.match(mid) == []
    pool.unpin(pinned)
    assert len(_save_all(pool, "newer", _hashes("newer", 4))) == 2  # evicts "old" now


def test_full_pool_with_everything_pinned_skips_save():
    pool = _pool(capacities=("128KiB", "128KiB"))
    a = _hashes("a", 4)
    _save_all(pool, "A", a)
    pool.pin([h.entry for h in pool.match(a)])
    assert pool.plan_saves("B", [(0, _hashes("b", 2))]) == []
    assert pool.lookups.save_skipped_full == 1


def test_failed_device_turns_into_misses_and_takes_no_chunks():
    pool = _pool(capacities=("4MiB", "4MiB"))
    a = _hashes("a", 8)
    planned = _save_all(pool, "A", a)
    assert {p.entry.location.device for p in planned} == {0, 1}
    pool.fail_device(1)
    hits = pool.match(a)
    assert all(h.entry.location.device == 0 for h in hits)
    assert sum(h.num_blocks for h in hits) == 2  # stops at the first chunk that was on dev 1
    more = _save_all(pool, "B", _hashes("b", 8))
    assert {p.entry.location.device for p in more} == {0}


def test_invalidate_while_reading_defers_slot_reuse():
    pool = _pool(capacities=("128KiB", "128KiB"))
    a = _hashes("a", 2)
    (p,) = _save_all(pool, "A", a)
    pool.pin([p.entry])
    pool.invalidate(p.entry.key)
    assert pool.match(a) == []
    assert pool.slots[p.entry.location.device].num_free == 0  # still being read
    pool.unpin([p.entry])
    assert pool.slots[p.entry.location.device].num_free == 1


def test_bandwidth_stripe_in_pool():
    pool = _pool(capacities=("64MiB", "64MiB"), gbps=(9.0, 3.0))
    planned = _save_all(pool, "A", _hashes("a", 32))
    assert Counter(p.entry.location.device for p in planned) == {0: 12, 1: 4}
