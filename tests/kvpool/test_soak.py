"""The soak's short mode: `kvpool serve` with the pool under concurrent streaming clients, an
SSD that fails and comes back, a restart; every completion equals a no-connector server's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


def test_soak_short_mode(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/soak_kvpool.py", "--short",
                           "--workdir", str(tmp_path / "work"), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    last = dict(kv.split("=") for kv in lines[-1].split())
    assert int(last["requests"]) >= 10, proc.stdout
    assert last["errors"] == "0" and last["mismatches"] == "0", proc.stdout
    assert int(last["restart_hits"]) > 0, proc.stdout  # SSD chunks served after the restart
    assert float(last["rss_growth_mib"]) < 1024, proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (tmp_path / "soak_kvpool_rss.png").stat().st_size > 1000
