"""The soak's short mode: `kvpool serve` with the pool under concurrent streaming clients, an
SSD that fails and comes back, injected I/O errors where the module has fault injection, a
restart; every completion equals a no-connector server's, and the run's files alone give its
counts again (what a killed run is left with)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
kvio = pytest.importorskip("vllm_kvpool._kvio")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
SOAK = [sys.executable, "benchmarks/soak_kvpool.py"]


def soak(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*SOAK, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def last_line(proc: subprocess.CompletedProcess) -> dict[str, str]:
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return dict(kv.split("=") for kv in lines[-1].split())


def test_soak_short_mode_and_its_files(tmp_path):
    work = tmp_path / "work"
    proc = soak("--short", "--workdir", work, "--out", tmp_path)
    last = last_line(proc)
    assert list(last) == ["requests", "errors", "mismatches", "restart_hits",
                          "io_errors_injected", "wrong_bytes", "rss_growth_mib"], proc.stdout  # fmt: skip
    assert int(last["requests"]) >= 10, proc.stdout
    assert last["errors"] == "0" and last["mismatches"] == "0", proc.stdout
    assert last["wrong_bytes"] == "0", proc.stdout
    assert int(last["restart_hits"]) > 0, proc.stdout  # SSD chunks served after the restart
    if getattr(kvio, "fault_injection", lambda: False)():
        assert int(last["io_errors_injected"]) >= 1, proc.stdout  # errors the engine counted
    else:
        assert last["io_errors_injected"] == "0" and "no fault injection" in proc.stdout
    assert float(last["rss_growth_mib"]) < 1024, proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (tmp_path / "soak_kvpool_rss.png").stat().st_size > 1000

    # every request and every reference answer is on disk: the files alone give the same line
    requests = (work / "requests.jsonl").read_text().splitlines()
    assert len(requests) == int(last["requests"])
    phases = {json.loads(r)["phase"] for r in requests}
    assert {"before", "after-restart"} <= phases, phases
    again = soak("--report-only", "--workdir", work, "--out", tmp_path / "again", timeout=120)
    assert again.stdout.strip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]
    assert again.returncode == 0, again.stdout

    # a run killed during its replay: half the reference answers, the last lifetime's status
    # only in the status file. Its counts come out; the unchecked requests fail the run. Its
    # copy of ssd0 has its data overwritten under intact index records: the byte check sees it.
    killed = tmp_path / "killed"
    shutil.copytree(work, killed, ignore=shutil.ignore_patterns("model"))
    reference = (work / "reference.jsonl").read_text().splitlines()
    (killed / "reference.jsonl").write_text("\n".join(reference[: len(reference) // 2]) + "\n")
    statuses = (work / "statuses.jsonl").read_text().splitlines()
    (killed / "statuses.jsonl").write_text(statuses[0] + "\n")
    meta = json.loads((killed / "run.json").read_text())
    for device in meta["pool"]["devices"]:
        if "ssd" in device:
            device["ssd"]["path"] = str(killed / Path(device["ssd"]["path"]).name)
    (killed / "run.json").write_text(json.dumps(meta))
    with open(killed / "ssd0.kvpool", "r+b") as f:
        f.write(b"\xff" * (48 << 20))  # the data region (48 MiB of 64 KiB slots)
    partial = soak("--report-only", "--workdir", killed, "--out", killed, timeout=120)
    counts = last_line(partial)
    assert counts["requests"] == last["requests"] and counts["errors"] == "0", partial.stdout
    assert counts["mismatches"] == "0" and counts["restart_hits"] == last["restart_hits"]
    assert int(counts["wrong_bytes"]) >= 64 << 10, partial.stdout  # a chunk or more
    assert "NOT CHECKED" in partial.stdout and partial.returncode == 1, partial.stdout
