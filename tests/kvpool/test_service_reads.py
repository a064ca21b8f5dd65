"""Issue #43's measurement of SSD reads in the service's place (``support/service_reads.py``,
the node benchmark's ``ssd_io`` part): a child process reads the engine's SSD chunks into a
shared memfd ring and the engine copies them into its KV in place; every byte must equal what the
engine saved, as the engine's own reads of the same prefix do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

kvio = pytest.importorskip("vllm_kvpool._kvio")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kvpool_node  # noqa: E402

pytestmark = pytest.mark.skipif("uring" not in kvio.backends(), reason="needs io_uring")


def test_service_side_reads_fetch_the_saved_bytes(tmp_path):
    res = bench_kvpool_node.Results(tmp_path / "out")
    ratio = bench_kvpool_node.bench_ssd_io(tmp_path, res, reps=2, layers=2, blocks=24)
    (row,) = [json.loads(line) for line in res.path.read_text().splitlines()]
    # bench_ssd_io exits on any wrong byte, missed block or failed checksum, of either path
    assert row["kind"] == "ssd_io" and row["blocks"] == 24
    assert len(row["seconds"]["engine"]) == len(row["seconds"]["service"]) == 2
    assert ratio == pytest.approx(row["median_s"]["service"] / row["median_s"]["engine"])
