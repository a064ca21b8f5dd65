"""Tensor parallelism through the connector: vLLM's real scheduler with TP=2, one worker connector
per rank over its own KV shard (rank r's shard holds other values than rank 0's), their outputs
merged by vLLM's own KVOutputAggregator. Each rank stores its own shard of every chunk in its own
files; a chunk is a hit only once every rank has saved its shard, a restart restores only chunks
every rank has an intact record of, and a rank's damaged shard is recomputed on every rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.model import write_tiny_llama  # noqa: E402
from support.vllm_harness import BLOCK_SIZE, Harness, corrupt_on_disk, make_vllm_config  # noqa: E402

TP = 2
PROMPT = list(range(3, 3 + 640))  # 20 blocks = 10 chunks of 64 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def pool_cfg(tmp_path) -> dict:
    # SSDs first and heavier: the prefix starts on them and survives a restart.
    return {"chunk_tokens": 64, "devices": [
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "4MiB", "bandwidth_gbps": 2.0}},
        {"ssd": {"path": str(tmp_path / "ssd1.bin"), "capacity": "4MiB", "bandwidth_gbps": 2.0}},
        {"host": {"capacity": "512KiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip


def engine(model_dir, tmp_path) -> Harness:
    return Harness.tensor_parallel(make_vllm_config(model_dir, pool_cfg(tmp_path)), TP,
                                   num_blocks=128)  # fmt: skip


def shutdown(h: Harness) -> None:
    for w, _ in h.ranks:
        w.shutdown()


def run_and_check(h: Harness, req_id: str, tokens: list[int], n_blocks: int) -> None:
    """Run a request; right after the pool's load, each rank's first n_blocks hold that rank's
    own shard of the prefix (byte for byte)."""
    h.add(req_id, tokens, max_tokens=2)
    checked = False
    for _ in range(100):
        h.step()
        req = h.requests[req_id]
        running = req_id in [r.request_id for r in h.scheduler.running]
        if not checked and running and req.num_computed_tokens >= n_blocks * BLOCK_SIZE:
            ids = h.block_ids(req_id)[:n_blocks]
            for rank, (_, kv) in enumerate(h.ranks):
                for b, block in enumerate(ids):
                    want = h.expected_block(tokens, b, rank)
                    for name, t in kv.items():
                        assert torch.equal(t[block], want[name]), (rank, b, name)
            checked = True
        if req_id in h.finished:
            break
    assert checked and req_id in h.finished


def test_each_rank_gets_its_own_shard_back(model_dir, tmp_path):
    h = engine(model_dir, tmp_path)
    assert h.connector.pool.world_size == TP
    assert [w.worker.rank for w, _ in h.ranks] == [0, 1]
    h.add("A", PROMPT + [900])
    h.run(["A"])
    h.drain()
    entries = h.connector.pool.index.entries.values()
    committed = [e for e in entries if e.committed]
    assert len(committed) == 10
    assert all(set(e.checksums) == {0, 1} for e in committed)  # both ranks' shards acknowledged
    assert all(e.checksums[0] != e.checksums[1] for e in committed)  # the shards differ
    for name in ("ssd0", "ssd1"):  # each rank writes its own file
        assert (tmp_path / f"{name}.bin.rank0").exists() and (tmp_path / f"{name}.bin.rank1").exists()
    for _, kv in h.ranks:  # a stale shard would survive a load that skipped its rank
        for t in kv.values():
            t.zero_()
    b_tokens = PROMPT[:600] + list(range(2000, 2100))  # 18 full blocks shared with A
    probe = Harness.make_request("probe", b_tokens)
    assert h.connector.get_num_new_matched_tokens(probe, 0)[0] == 18 * BLOCK_SIZE
    run_and_check(h, "B", b_tokens, 18)
    shutdown(h)


def test_restart_restores_chunks_every_rank_has_and_a_damaged_shard_is_recomputed(model_dir,
                                                                                   tmp_path):  # fmt: skip
    h = engine(model_dir, tmp_path)
    h.add("A", PROMPT + [900])
    h.run(["A"])
    h.drain()
    shutdown(h)

    h = engine(model_dir, tmp_path)
    pool = h.connector.pool
    assert pool.lookups.restored >= 2
    probe = Harness.make_request("probe", PROMPT + [5])
    matched, _ = h.connector.get_num_new_matched_tokens(probe, 0)
    assert matched >= 4 * BLOCK_SIZE  # ssd0, ssd1 chunks lead the prefix
    # Damage rank 1's shard of the first chunk: its load fails verification on rank 1 only,
    # and the request must still see every rank's true KV (those blocks recomputed).
    first = pool.lookup(probe.block_hashes)[0].entry
    rank1 = h.peers[0][0].engine.tiers[first.location.device]
    corrupt_on_disk(rank1, first.location.slot)
    run_and_check(h, "B", PROMPT + [5], matched // BLOCK_SIZE)
    assert pool.lookups.restored_hits >= 1
    assert pool.lookups.invalidated == 1  # rank 1's verification dropped the chunk
    shutdown(h)
