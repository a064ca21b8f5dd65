"""benchmarks/bench_ttft.py on a tiny model through a real `kvpool serve`: the timed requests'
suffixes are new (the pool serves exactly the prefix, never a suffix token), the pool and the
reference compute the same tokens, and the same prompt after a fetch gives the recompute's
token (the bench raises otherwise). Timings are the benchmark's business, not asserted here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ttft.py"


def test_new_suffixes_are_computed_and_the_prefix_served(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_ttft", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_ttft"] = bench
    spec.loader.exec_module(bench)
    assert bench.main(["--prefix-tokens", "512", "--suffix-lengths", "16,48", "--reps", "1",
                       "--layers", "2", "--workdir", str(tmp_path), "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split())
    assert (fields["suffix_tokens"], fields["served_from_pool"], fields["computed"]) == \
        ("48", "512", "48")
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["suffix"], r["served"], r["computed"]) for r in rows] == [(16, 512, 16),
                                                                         (48, 512, 48)]
    assert (tmp_path / "bench_ttft.png").stat().st_size > 0
