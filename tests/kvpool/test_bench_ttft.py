"""benchmarks/bench_ttft.py on a tiny model through a real `kvpool serve`: the timed requests'
suffixes are new (the pool serves exactly the prefix, never a suffix token), the pool and the
reference compute the same tokens, and the same prompt after a fetch gives the recompute's
token (the bench raises otherwise). Timings are the benchmark's business, not asserted here."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_benchmark

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")


def test_new_suffixes_are_computed_and_the_prefix_served(tmp_path, capsys):
    bench = load_benchmark("bench_ttft")
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
