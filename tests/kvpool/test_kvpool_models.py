"""benchmarks/kvpool_models.py: each device's share alone (the in-run bound's parts) reads only
that device's chunks, and the shares together are the whole fetch (timings are the benchmark's
business, not asserted here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_kvpool._kvio")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kvpool_models import BLOCK, CHUNK, ModelPool  # noqa: E402

from vllm_kvpool.geometry import MODELS  # noqa: E402


@pytest.mark.parametrize("hma", [True, False])
def test_shares_alone_partition_the_fetch(tmp_path, hma):
    layout = MODELS["gpt-oss-20b"].chunk_layout(BLOCK, CHUNK, hma=hma)
    pool = ModelPool(layout, 2048, tmp_path, f"m{hma}")
    try:
        pool.save()
        assert len(pool.devices) == 2  # host and SSD both hold part of the prefix
        whole = pool.fetch()
        alone = [pool.fetch(d) for d in pool.devices]
        assert all(0 < r.device_bytes < whole.device_bytes for r in alone)
        assert sum(r.device_bytes for r in alone) == whole.device_bytes
    finally:
        pool.close()
