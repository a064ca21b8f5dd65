"""The predictors' import graph (read from source, every import counted, deferred ones too) has
no cycle, and the cache key derived from it follows the code a computation can reach."""

from __future__ import annotations

from pathlib import Path

import predictors
from predictors.codegraph import closure, code_version, find_cycle, import_graph

ROOT = Path(predictors.__file__).parent


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_predictors_have_no_import_cycle():
    graph = import_graph(ROOT, "predictors")
    assert "predictors.time.features" in graph and "predictors.memory.api" in graph
    assert find_cycle(graph) is None


def test_the_layers_point_one_way():
    """The vocabulary imports no predictor; the data loaders reach no time or memory model (a
    fleet row names its efficiency group with :func:`predictors.time.efficiency.fit_group`,
    which reaches only the vocabulary and the device table)."""
    graph = import_graph(ROOT, "predictors")
    spec = closure(graph, [m for m in graph if m.startswith("predictors.spec")])
    assert all(m.startswith("predictors.spec") for m in spec), spec
    loaders = closure(graph, [m for m in graph if m.startswith("predictors.datasets")])
    reached = {m for m in loaders if m.startswith(("predictors.time", "predictors.memory"))}
    assert reached == {"predictors.time.efficiency"}, reached


def test_a_deferred_relative_import_cycle_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..a import x\n    return x\n",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"],
                                 ["pkg.sub.b", "pkg.a", "pkg.sub.b"])


def test_code_version_follows_the_import_closure(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "top.py": "import pkg.used\n",
        "used.py": "X = 1\n",
        "other.py": "Y = 1\n",
    })
    before = code_version("pkg.top", root=root, package="pkg")
    (root / "other.py").write_text("Y = 2\n")
    assert code_version("pkg.top", root=root, package="pkg") == before
    (root / "used.py").write_text("X = 2\n")
    assert code_version("pkg.top", root=root, package="pkg") != before
