"""The LLaVA-1.5 published outcomes (predictors/data/llava_outcomes.csv) each name their source
and a stated configuration, and the benchmark scores every row the presets can describe
through ``predict_peak_memory`` (LoRA rows listed, not scored)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_outcome_has_a_source_and_the_scorable_ones_are_scored():
    path = ROOT / "predictors" / "data" / "llava_outcomes.csv"
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["source"].startswith("https://github.com/haotian-liu/LLaVA")
                        and r["outcome"] in ("fits", "oom") for r in rows)
    assert {r["outcome"] for r in rows if r["lora"] == "0"} == {"fits", "oom"}
    spec = importlib.util.spec_from_file_location(
        "bench_memory_predictor", ROOT / "benchmarks" / "bench_memory_predictor.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_memory_predictor"] = bench
    spec.loader.exec_module(bench)
    right, scored = bench.llava_outcomes(path)
    assert scored == sum(r["lora"] == "0" for r in rows) and 0 <= right <= scored
