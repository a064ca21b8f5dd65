"""Each plugin installs on its own, as its users install it (issue 47).

The wheel is built here without a C++ compiler (``CXX`` points nowhere), as a predictors- or
CONA-only user builds it: the install succeeds without the C++ core, declares the torch it was
tested with for the extras that import torch, and each CLI starts from a clean venv; ``kvpool``,
which needs the core, says what to install. The serving plugin's wheel is built too, with the
core and as a user gets it (no fault injection), and probes a file through it. Each clean venv
gets the wheel alone; its engines (torch, lightgbm, ...) come from this checkout's venv through
a ``.pth`` line after its own site-packages, since the tests must not download (the extras'
resolution is read from the wheel's metadata instead).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow  # builds two wheels (one compiles the core) and venvs: ~60 s

ROOT = Path(__file__).resolve().parents[2]
TESTED_TORCH = "2.13.0"  # requirements/test-env.txt


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A clone's files (pip builds in the source tree: the checkout's build/ must not be used)."""
    clone = tmp_path_factory.mktemp("clone")
    files = _run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, clone / rel)
    return clone


def _wheel_in_clean_venv(clone: Path, tmp: Path, env: dict[str, str]) -> tuple[Path, Path, str]:
    """Build the wheel from ``clone`` with ``env``, install it alone into a fresh venv under
    ``tmp``; returns (the venv's bin/, the wheel, the build's output)."""
    shutil.rmtree(clone / "build", ignore_errors=True)
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp / "dist"), str(clone)], env={**os.environ, **env}, cwd=tmp)  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    wheel = next((tmp / "dist").glob("llm_sys_plugins-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).check_returncode()
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                   .stdout.strip())  # fmt: skip
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                 str(wheel)], cwd=tmp)  # fmt: skip
    assert inst.returncode == 0, inst.stderr
    (purelib / "zz_engines.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin", wheel, build.stdout + build.stderr


@pytest.fixture(scope="module")
def clean_venv(clone, tmp_path_factory) -> tuple[Path, Path]:
    """(the venv's bin/, the wheel) for a wheel built without a compiler, installed alone."""
    tmp = tmp_path_factory.mktemp("pure")
    bindir, wheel, log = _wheel_in_clean_venv(
        clone, tmp, {"CXX": str(tmp / "no-compiler" / "g++"), "KVPOOL_BUILD_CORE": "auto"})
    assert "the C++ core vllm_kvpool._kvio was not built" in log
    return bindir, wheel


def test_extras_declare_the_tested_torch(clean_venv):
    _, wheel = clean_venv
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [Requirement(line.split(":", 1)[1].strip())
                for line in zf.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]  # fmt: skip
        assert not any(n.endswith(".so") for n in zf.namelist())  # no compiler: no core
    for extra in ("predictors", "cona"):
        torch = [r for r in reqs if r.name == "torch" and r.marker
                 and r.marker.evaluate({"extra": extra})]  # fmt: skip
        assert torch, f"extra {extra} does not declare torch"
        assert all(r.specifier.contains(TESTED_TORCH) for r in torch)
        assert not any(r.specifier.contains("2.14.1") for r in torch), torch
    base = [r.name for r in reqs if r.marker is None]
    assert "torch" not in base  # the serving plugin's torch comes with its vLLM wheel


def test_each_cli_runs_from_the_clean_venv(clean_venv, tmp_path):
    bindir, _ = clean_venv
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cli in ("predict", "cona", "kvpool"):
        out = _run([str(bindir / cli), "--help"], cwd=tmp_path, env=env)
        assert out.returncode == 0 and "usage:" in out.stdout, (cli, out.stderr)
    # one real command each: a prediction from the shipped model, and a config validation
    pred = _run([str(bindir / "predict"), "time", "--layers", "2",
                 "--hidden", "256", "--heads", "4", "--seq", "256", "--json"],
                cwd=tmp_path, env=env)  # fmt: skip
    assert pred.returncode == 0, pred.stderr
    assert str(bindir.parent) in _run([str(bindir / "python"), "-c",
                                        "import predictors; print(predictors.__file__)"],
                                       cwd=tmp_path, env=env).stdout  # fmt: skip
    assert json.loads(pred.stdout)
    # a user's model factory in the working directory (mypkg/models.py), as the docs name it
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 8, 3), "
        "nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))\n")
    mem = _run([str(bindir / "predict"), "memory", "--model", "module", "--module",
                "mypkg.models:build", "--input-shape", "3x16x16", "--batch", "4", "--device",
                "h100-80gb"], cwd=tmp_path, env=env)  # fmt: skip
    assert mem.returncode == 0 and "FITS" in mem.stdout, mem.stdout + mem.stderr
    cfg = json.dumps({"devices": [{"host": {"capacity": "64MiB"}}], "chunk_tokens": 256})
    val = _run([str(bindir / "kvpool"), "validate", "--config", cfg], cwd=tmp_path, env=env)
    assert val.returncode == 0 and json.loads(val.stdout)["chunk_tokens"] == 256, val.stderr
    # the core is what the install left out: kvpool names it and its fix, no traceback
    probe = _run([str(bindir / "kvpool"), "probe", "--config", cfg], cwd=tmp_path, env=env)
    assert probe.returncode == 2
    assert "vllm_kvpool._kvio is not built" in probe.stderr and "liburing-dev" in probe.stderr
    assert "Traceback" not in probe.stderr


def test_the_serving_plugins_wheel_has_the_core_built_for_users(clone, tmp_path):
    """The serving plugin's wheel: the core built (a failure would fail the install), without
    the test build's fault injection, and kvpool probe reading a real file through it."""
    bindir, wheel, _ = _wheel_in_clean_venv(clone, tmp_path, {"KVPOOL_BUILD_CORE": "1",
                                                               "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    with zipfile.ZipFile(wheel) as zf:
        assert any(n.startswith("vllm_kvpool/_kvio") and n.endswith(".so") for n in zf.namelist())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    info = _run([str(bindir / "python"), "-c", "from vllm_kvpool import _kvio; "
                 "print(_kvio.__file__, _kvio.fault_injection(), 'uring' in _kvio.backends())"],
                cwd=tmp_path, env=env)  # fmt: skip
    path, faults, uring = info.stdout.split()
    assert path.startswith(str(bindir.parent)) and faults == "False" and uring == "True", info
    cfg = json.dumps({"devices": [{"host": {"capacity": "64MiB"}},
                                  {"ssd": {"path": str(tmp_path / "d.bin"), "capacity": "64MiB"}}],
                      "probe": {"seconds": 0.2, "size": "16MiB"}})  # fmt: skip
    probe = _run([str(bindir / "kvpool"), "probe", "--config", cfg], cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr
    assert float(probe.stdout.split("sum_gbps=")[1]) > 0
