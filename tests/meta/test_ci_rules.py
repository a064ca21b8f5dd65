"""The suite's CI rules (tests/conftest.py): a missing required engine fails a CI run with its
name instead of skipping, outside CI it still skips, the run reports tests per package, the
serving room's tests keep to one worker, and too little disk stops a run at its start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REQUIRED, disk_shortfall, required_skip

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _suite(tmp_path: Path) -> Path:
    """A copy of the rules requiring one engine that does not exist, and a test needing it."""
    root = tmp_path / "tests"
    (root / "pkg").mkdir(parents=True)
    (root / "conftest.py").write_text(CONFTEST.read_text().replace(
        "REQUIRED = {", 'REQUIRED = {\n    "kvpool_absent_engine": "a test engine",', 1))
    (root / "pkg" / "test_needs.py").write_text(
        "import pytest\n\nengine = pytest.importorskip('kvpool_absent_engine')\n\n\n"
        "def test_uses_it():\n    assert engine\n")
    (root / "pkg" / "test_plain.py").write_text("def test_runs():\n    assert 1 + 1 == 2\n")
    return tmp_path


def _pytest(where: Path, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ci_fails_naming_the_missing_engine(tmp_path):
    r = _pytest(_suite(tmp_path), ci=True)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "kvpool_absent_engine (a test engine)" in r.stdout + r.stderr


def test_outside_ci_the_test_skips_and_packages_are_counted(tmp_path):
    r = _pytest(_suite(tmp_path), ci=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tests per package" in r.stdout
    assert "pkg: 1 passed, 1 skipped" in r.stdout


def test_skip_reasons_naming_a_required_engine():
    assert required_skip("could not import 'vllm': No module named 'vllm'") == "vllm"
    assert required_skip("No module named 'megatron.core'") == "megatron.core"
    assert required_skip("SPDK target unset") is None
    assert set(REQUIRED) >= {"vllm", "vllm_kvpool._kvio", "megatron.core", "lightgbm"}


def test_the_serving_rooms_tests_run_on_one_worker_under_make_tests_flags(tmp_path):
    """``make test``'s ``-n 2 --dist loadgroup`` keeps the serving room's tests (tests/kvpool,
    tests/kvio) on one worker, the rest on one: the marks conftest.py adds must reach xdist's
    scheduler (they did not, silently, while the hook ran after xdist's or under pytest 9.2,
    pytest-xdist#1386), shown by the ``@group`` suffix each test reports with."""
    root = tmp_path / "tests"
    root.mkdir()
    (root / "conftest.py").write_text(CONFTEST.read_text())
    for room in ("kvpool", "kvio", "cona", "predictors"):
        (root / room).mkdir()
        (root / room / f"test_{room}.py").write_text("".join(
            f"def test_{i}():\n    assert {i} == {i}\n\n\n" for i in range(4)))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n",
                        "2", "--dist", "loadgroup", "tests"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    workers: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        if "PASSED" in line:
            worker, nodeid = line.split()[0], line.split()[-1]
            room = nodeid.split("/")[1]
            group = nodeid.rpartition("@")[2]
            assert group == ("serving" if room in ("kvpool", "kvio") else "rest"), line
            workers.setdefault(group, set()).add(worker)
    assert sum(1 for line in r.stdout.splitlines() if "PASSED" in line) == 16, r.stdout
    assert all(len(w) == 1 for w in workers.values()), workers


def test_too_little_disk_for_the_tmp_dirs_is_named_before_the_run(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    assert disk_shortfall(tmp_path, need=1) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 30))
    why = disk_shortfall(tmp_path, need=4 << 30)
    assert why is not None and str(tmp_path) in why and "1.0 GiB free" in why, why
