"""The kit's long-prefix TTFT part (issue #46 item 5) as a CPU dry run through the real entry
point (``scripts/gpu_check.py --dry-run --parts ttft``): a tiny Llama-shaped model with random
weights, prefixes held in a host pool and a file, fetched by the pool's load path into the paged
KV, a new suffix prefilled over them; the suffix must be new (the pool serves exactly the
prefix), the fetched KV byte-identical, and the first token the full recompute's."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("vllm_kvpool._kvio")

ROOT = Path(__file__).resolve().parents[2]


def test_ttft_dry_run_serves_the_prefix_and_gives_the_recomputes_first_token(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run",
                           "--parts", "ttft", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["schema_errors"] == [] and list(run["parts"]) == ["ttft"]
    assert run["parts"]["ttft"]["status"] == "ok", run["parts"]
    with open(out / "kvio.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["test"] == "ttft"]
    assert len(rows) == 2  # the dry run's two prefix lengths
    for row in rows:
        d = json.loads(row["detail"])
        assert row["status"] == "ok" and row["byte_exact"] == "true"
        assert d["served_tokens"] == d["tokens"]  # the prefix from the pool, the suffix computed
        assert d["same_token"] and d["token"] == d["token_recompute"]
        assert d["pool_s"] >= d["fetch_s"] > 0 and d["recompute_s"] > 0
