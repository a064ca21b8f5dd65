"""Several devices: the capacity-constrained optimum against brute force, placement over
heterogeneous devices, and a pool of two host pools + two SSD files round-tripping KV byte-exact."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from tests.kvpool.placement_oracle import fetch_seconds, optimal_fetch
from vllm_kvpool.config import parse_pool_config
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.placement import DeviceWeights
from vllm_kvpool.pool import UnifiedPool


def brute_force(num_chunks: int, chunk: int, gbps: list[float], caps: list[int]) -> float:
    best = float("inf")
    for counts in itertools.product(*(range(c + 1) for c in caps)):
        if sum(counts) == num_chunks:
            best = min(best, fetch_seconds([n * chunk for n in counts], gbps))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_optimal_fetch_matches_brute_force(seed):
    rng = random.Random(seed)
    devices = rng.randint(1, 4)
    gbps = [rng.choice([0.5, 1.0, 2.9, 3.3, 12.0, 25.0, rng.uniform(0.1, 30)])
            for _ in range(devices)]  # fmt: skip
    caps = [rng.randint(0, 7) for _ in range(devices)]
    if sum(caps) == 0:
        caps[0] = 1
    num_chunks = rng.randint(1, sum(caps))
    chunk = rng.choice([1, 4096, 32 << 20])
    seconds, counts = optimal_fetch(num_chunks, chunk, gbps, caps)
    assert sum(counts) == num_chunks
    assert all(0 <= n <= c for n, c in zip(counts, caps, strict=True))
    assert seconds == pytest.approx(fetch_seconds([n * chunk for n in counts], gbps), rel=1e-12)
    assert seconds == pytest.approx(brute_force(num_chunks, chunk, gbps, caps), rel=1e-12)


def test_optimal_fetch_when_the_host_cannot_hold_the_prefix():
    # 128 chunks of 32 MiB; host 25 GB/s holds 112, SSD 3 GB/s: the summed-bandwidth "limit"
    # (4.3 GiB / 28 GB/s) is not reachable, the optimum puts 112 on the host and 16 on the SSD.
    chunk = 32 << 20
    seconds, counts = optimal_fetch(128, chunk, [25.0, 3.0], [112, 1000])
    assert counts == [112, 16]
    assert seconds == pytest.approx(max(112 * chunk / 25e9, 16 * chunk / 3e9))
    assert seconds > 128 * chunk / 28e9


def test_optimal_fetch_rejects_bad_input():
    with pytest.raises(ValueError, match="exceeds the capacity"):
        optimal_fetch(5, 1, [1.0, 0.0], [2, 10])  # a device without bandwidth takes nothing
    with pytest.raises(ValueError, match="2 bandwidths but 1 capacities"):
        optimal_fetch(1, 1, [1.0, 2.0], [3])


def geometry(chunk_bytes: int = 4096, blocks: int = 1) -> ChunkLayout:
    return ChunkLayout.uniform(chunk_bytes // blocks, blocks, 7)


def pool_over(gbps: list[float], slots: list[int], placement: str) -> UnifiedPool:
    g = geometry()
    kinds = ["host", "host"] + ["ssd"] * (len(gbps) - 2)
    devices = [{k: {"capacity": n * g.slot_bytes, **({"path": f"/tmp/kvpool-placement-ssd{i}"} if k == "ssd" else {})}}
               for i, (k, n) in enumerate(zip(kinds, slots, strict=True))]  # fmt: skip
    config = parse_pool_config({"chunk_tokens": 16, "placement": placement, "devices": devices})
    return UnifiedPool(config, g, DeviceWeights(list(gbps)))


def place(pool: UnifiedPool, num_chunks: int) -> list[int]:
    chunks = [(i, [f"b{i}".encode()]) for i in range(num_chunks)]
    return [p.entry.location.device for p in pool.plan_saves("r", chunks)]


@pytest.mark.parametrize("slots", [[1000] * 5, [10, 6, 1000, 1000, 1000]])
def test_bandwidth_placement_over_five_heterogeneous_devices(slots):
    # two host pools (one per NUMA node) and three SSDs of different speeds
    gbps = [20.0, 12.0, 3.0, 1.5, 0.5]
    num_chunks = 74
    devices = place(pool_over(gbps, slots, "bandwidth"), num_chunks)
    counts = [Counter(devices)[d] for d in range(5)]
    chunk = geometry().chunk_bytes
    best, _ = optimal_fetch(num_chunks, chunk, gbps, slots)
    t_bw = fetch_seconds([n * chunk for n in counts], gbps)
    # largest remainder is within one chunk per device of the optimum
    assert t_bw <= best + chunk / min(gbps) / 1e9 + 1e-12
    assert all(n <= s for n, s in zip(counts, slots, strict=True))
    assert set(devices[:5]) >= {0, 1}  # striped from the start, not filled in order
    rr = [Counter(place(pool_over(gbps, slots, "round_robin"), num_chunks))[d] for d in range(5)]
    serial = [Counter(place(pool_over(gbps, slots, "single_tier_serial"), num_chunks))[d]
              for d in range(5)]  # fmt: skip
    assert t_bw < fetch_seconds([n * chunk for n in rr], gbps)
    assert t_bw <= fetch_seconds([n * chunk for n in serial], gbps)


def test_two_host_pools_and_two_ssd_files_round_trip(tmp_path):
    """Chunks striped over 2 host pools + 2 SSD files (O_DIRECT io_uring on one, posix on the
    other) come back byte-exact into KV tensors, each device serving its share."""
    pytest.importorskip("vllm_kvpool._kvio")
    from vllm_kvpool.local import LocalPool

    layers, blocks, heads, bs, hd = 3, 64, 2, 16, 64
    kv = {f"l{i}": torch.empty(blocks, 2, bs, heads, hd, dtype=torch.bfloat16)
          for i in range(layers)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for t in kv.values():
        t.view(torch.int16).copy_(torch.randint(-(2**14), 2**14, t.shape, generator=gen))
    reference = {k: t.clone() for k, t in kv.items()}
    chunk = 4 * 2 * bs * heads * hd * 2 * layers  # 4 blocks per chunk, all layers
    n_chunks = blocks // 4
    config = {
        "chunk_tokens": 4 * bs, "staging": 4 * chunk,
        "devices": [{"host": {"capacity": 3 * chunk}}, {"host": {"capacity": 3 * chunk}},
                    {"ssd": {"path": str(tmp_path / "a.kvpool"), "backend": "uring",
                             "capacity": n_chunks * chunk}},
                    {"ssd": {"path": str(tmp_path / "b.kvpool"), "backend": "posix",
                             "capacity": n_chunks * chunk}}]}  # fmt: skip
    hashes = [f"h{i}".encode() for i in range(blocks)]
    ids = list(range(blocks))
    with LocalPool(config, kv, blocks, bs, bandwidths=[8.0, 8.0, 3.0, 1.0]) as pool:
        assert pool.save(hashes, ids) == n_chunks
        for t in kv.values():
            t.zero_()
        result = pool.fetch(hashes, ids)
        assert result.ok and result.blocks == blocks
        status = pool.status()
        read = {k: c.bytes_read for k, c in status.transfers.devices.items()}
        written = {k: c.bytes_written for k, c in status.transfers.devices.items()}
        weights = pool.pool.weights
    assert set(read) == {"host0", "host1", "ssd0", "ssd1"} and all(read.values())
    # Every load and save was measured for placement: each device's bytes, with busy time.
    names = [u.name for u in status.usage]
    assert [weights.reads[d].moved for d in range(4)] == [read[n] for n in names]
    assert [weights.writes[d].moved for d in range(4)] == [written[n] for n in names]
    assert sum(read.values()) == n_chunks * chunk
    for k, t in kv.items():
        assert torch.equal(t.view(torch.int16), reference[k].view(torch.int16)), k
