"""benchmarks/kvpool_models.py: the paper's models' KV geometry, and each device's share alone
(the in-run bound's parts) reads only that device's chunks, the shares together being the whole
fetch (timings are the benchmark's business, not asserted here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_kvpool._kvio")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kvpool_models import BLOCK, MODELS, ModelPool  # noqa: E402

from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.layout import build as layouts  # noqa: E402


@pytest.mark.parametrize(("model", "per_token", "fetch_32k"), [
    ("llama-3.1-8b", 131072, 4 * 2**30),  # 32 layers x 8 heads x 128 x K,V x bf16
    ("qwen3-30b-a3b", 98304, 3 * 2**30),  # 48 x 4 x 128 x 2 x 2
    ("gpt-oss-20b", 36864, 12 * 2048 * (32768 + 128)),  # full every token, window 128 at the end
])  # fmt: skip
def test_paper_model_geometry(model, per_token, fetch_32k):
    config = load_pool_config({"chunk_tokens": 256, "devices": [{"host": {"capacity": "1GiB"}}]})
    on = layouts.from_model(config, MODELS[model], BLOCK)
    assert on.bytes_per_token(BLOCK) == per_token
    assert on.fetch_bytes(32768 // BLOCK) == fetch_32k
    if MODELS[model].sliding_layers:
        off = layouts.from_model(config, MODELS[model], BLOCK, hma=False)
        assert off.fetch_bytes(32768 // BLOCK) == 24 * 2048 * 32768  # 1.5 GiB with HMA off
        assert off.bytes_per_token(BLOCK) == 49152


@pytest.mark.parametrize("hma", [True, False])
def test_shares_alone_partition_the_fetch(tmp_path, hma):
    pool = ModelPool(MODELS["gpt-oss-20b"], hma, 2048, tmp_path, f"m{hma}")
    try:
        pool.save()
        assert len(pool.devices) == 2  # host and SSD both hold part of the prefix
        whole = pool.fetch()
        alone = [pool.fetch(d) for d in pool.devices]
        assert all(0 < r.device_bytes < whole.device_bytes for r in alone)
        assert sum(r.device_bytes for r in alone) == whole.device_bytes
    finally:
        pool.close()
