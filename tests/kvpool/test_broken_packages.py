"""Optional torch packages that cannot load are hidden from vLLM exactly as if not installed; one
that loads is left alone; vLLM's spawned engine processes hide what their parent hid."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from vllm_kvpool import broken_packages


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A torchvision that fails as PyPI's CUDA build does beside the CPU torch, and a torchaudio
    that loads, first on the path of this interpreter and of the check's child."""
    for name, body in (("torchvision", 'raise RuntimeError("operator torchvision::nms does '
                                       'not exist")\n'),
                       ("torchaudio", "LOADED = True\n")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(broken_packages.ENV, "")  # restored (unset) after the test
    yield tmp_path
    for name in ("torchvision", "torchaudio"):
        sys.modules.pop(name, None)


def test_a_broken_package_is_hidden_as_if_not_installed(fakes, capsys):
    assert broken_packages.hide_broken() == {
        "torchvision": "RuntimeError: operator torchvision::nms does not exist"}
    # what transformers' is_torchvision_available() and vLLM's imports see
    assert importlib.util.find_spec("torchvision") is None
    with pytest.raises(ModuleNotFoundError):
        import torchvision  # noqa: F401
    import torchaudio  # loads: left alone

    assert torchaudio.LOADED and importlib.util.find_spec("torchaudio") is not None
    assert os.environ[broken_packages.ENV] == "torchvision"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchvision::nms" in err  # one note, with the fix
    assert "pip uninstall -y torchvision torchaudio torchcodec" in err
    import torch

    minor = int(torch.__version__.split(".")[1])  # the CPU builds made for this torch
    assert f"'torchvision==0.{minor + 15}.*' 'torchaudio==2.{minor}.*'" in err
    assert broken_packages.hide_broken() == {}  # hidden once: no second check, no second note
    assert capsys.readouterr().err == ""


def test_nothing_installed_nothing_checked(monkeypatch):
    monkeypatch.setattr(subprocess, "run", None)  # no child interpreter may start
    assert broken_packages.hide_broken(("kvpool_no_such_package",)) == {}


def test_an_engine_process_hides_what_its_parent_hid(fakes):
    # vLLM's CPU engine processes are spawned: their __main__ is the kvpool CLI, imported first
    code = ("import vllm_kvpool.cli, importlib.util; "
            "print(importlib.util.find_spec('torchvision'), "
            "importlib.util.find_spec('torchaudio') is not None)")  # fmt: skip
    env = {**os.environ, broken_packages.ENV: "torchvision",
           "PYTHONPATH": os.pathsep.join([str(fakes), os.getcwd()])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None", "True"], out.stderr
    assert "kvpool: note" not in out.stderr  # the parent said it once
