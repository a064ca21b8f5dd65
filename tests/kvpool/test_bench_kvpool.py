"""benchmarks/bench_kvpool.py's systems run on a tiny prefix and return byte-identical KV, so a
broken baseline fails CI (its timings are the benchmark's business, not asserted here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_kvpool._kvio")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kvpool.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kvpool", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kvpool"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tiny(bench):
    return bench.Geometry(layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16,
                          tokens=1024, chunk_tokens=256)  # fmt: skip


@pytest.mark.parametrize("placement", ["bandwidth", "single_tier_serial", "round_robin"])
def test_pool_paths_fetch_identical_kv(bench, tmp_path, placement):
    g = tiny(bench)
    s = bench.slot(g)
    devices = [{"host": {"capacity": 2 * s}},
               {"ssd": {"path": str(tmp_path / "ssd0.kvpool"), "backend": "uring",
                        "capacity": 5 * s}}]  # fmt: skip
    spec = {"system": "pool", "scenario": "smoke", "salt": "smoke",
            "config": bench.pool_config(g, devices, placement), "gbps": [8.0, 2.0]}  # fmt: skip
    r = bench.run_pool(g, spec)
    assert r.identical and r.seconds > 0
    assert sum(r.device_bytes.values()) == g.prefix_bytes
    assert r.device_bytes["host0"] == 2 * g.chunk_bytes  # host full, the rest from the SSD


def test_lmcache_path_fetches_identical_kv(bench, tmp_path):
    reason = bench.lmcache_available()
    if reason is not None:
        pytest.skip(reason)
    g = tiny(bench)
    gib = (g.num_chunks + 4) * g.chunk_bytes / 2**30
    spec = {"system": "lmcache-slice-odirect", "scenario": "smoke", "salt": "smoke",
            "copy": "slice", "odirect": True, "disk_dir": str(tmp_path / "lmc"), "disk_gib": gib,
            "cpu_gib": gib, "resident": 2}  # fmt: skip
    r = bench.run_lmcache(g, spec)
    assert r.identical
    assert r.device_bytes == {"lmcache-cpu": 2 * g.chunk_bytes,
                              "lmcache-disk": (g.num_chunks - 2) * g.chunk_bytes}  # fmt: skip


def test_summary_line_and_optimum(bench, tmp_path):
    g = tiny(bench)
    r = bench.Result("pool-bw", "S1", 0.5, g.prefix_bytes, 0.0, True, {"host0": 1, "ssd0": 1})
    s = bench.Result("pool-serial", "S1", 1.0, g.prefix_bytes, 0.0, True, {"host0": 1, "ssd0": 1})
    args = type("A", (), {"out": None})()
    line = bench.summarize(g, {"S1/pool-bw": [r], "S1/pool-serial": [s]},
                           {"S1": {"gbps": [4.0, 1.0], "opt_s": 0.25, "names": ["host0", "ssd0"]}},
                           args, lambda *_: None)  # fmt: skip
    assert line.startswith("ratio_vs_lmcache=nan ratio_vs_lmcache_multi=nan")
    assert "ratio_vs_serial_same_engine=2.00 frac_of_optimum=0.50" in line
