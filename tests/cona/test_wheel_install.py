"""megatron_cona works when installed from a wheel: nothing in it imports the repository's
CPU launcher (megatron_cpu, which setup.py does not package), no evaluation-only code is
installed (the law check's real-curve training lives in benchmarks/), its law-simulation modules
import from the installed copy with the repository NOT on the path, and `cona scale` runs from
it on a tiny case."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_megatron_cona_imports_from_an_installed_wheel(core_wheel, tmp_path):
    """``core_wheel``: the session's wheel of a clone, as ``pip wheel .`` builds it with a
    compiler (tests/conftest.py)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(core_wheel)], check=True, cwd=tmp_path)
    assert not (target / "megatron_cpu").exists()  # not packaged: nothing may need it
    assert not (target / "megatron_cona" / "ttp").exists()  # the retired harness
    assert not list(target.glob("**/cona_curves.py"))  # evaluation code stays in benchmarks/
    for path in (target / "megatron_cona").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "megatron_cpu" for n in names), path
    # the checkout itself leaves the path (its .venv, which may sit inside it, stays)
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); "
            "sys.path[:] = [p for p in sys.path "
            "if os.path.realpath(p or '.') != os.path.realpath(sys.argv[2])]; "
            "import megatron_cona.lawsim.evaluate, megatron_cona.cli; "
            "print(megatron_cona.lawsim.evaluate.__file__, megatron_cona.cli.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(target), str(ROOT)], check=True,
                         capture_output=True, text=True, cwd=tmp_path, env=env).stdout
    assert all(f.startswith(str(target)) for f in out.split()), out
    # and `cona scale` runs from the installed copy on a tiny case, to its result line
    run = ("import os, sys; sys.path.insert(0, sys.argv[1]); "
           "sys.path[:] = [p for p in sys.path "
           "if os.path.realpath(p or '.') != os.path.realpath(sys.argv[2])]; "
           "from megatron_cona.cli import main; sys.exit(main(sys.argv[3:]))")
    out = subprocess.run([sys.executable, "-c", run, str(target), str(ROOT), "scale",
                          "--families", "gpt3-1.3b", "--gpus", "64", "--variants", "kaplan",
                          "--switch-costs", "0.04,0.001", "--out", str(tmp_path / "scale")],
                         check=True, capture_output=True, text=True, cwd=tmp_path,
                         env=env).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("gpus=64 law=kaplan sim_checks=3/3 ") and "speedup_vs_tuned_static=" \
        in last, out[-2000:]
