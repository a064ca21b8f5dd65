"""The import graph of a package, read from its source (nothing is imported), and a version of
the code a result depends on: the hash of every module its import closure reaches.

Caches of derived results (the time predictor's feature rows, the memory benchmark's
predictions) are keyed by :func:`code_version` of the module that computes them, so a change to
any module that computation can reach invalidates them, and a change elsewhere does not; a new
module joins the key by being imported, not by being listed. Every import counts, those inside
functions too: a deferred import still runs the module."""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path


def _module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module under ``root`` (the package's directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    # a package's own __init__ is the level-1 anchor; a plain module's parent is
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: str | Path, package: str) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, over every module of ``package``
    (whose directory is ``root``). ``from a import b`` is an edge to ``a.b`` where that is a
    module, else to ``a``."""
    files = _module_files(Path(root), package)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(name, is_package, node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src
                           for a in node.names]  # fmt: skip
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``) or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def closure(graph: dict[str, set[str]], modules: Iterable[str]) -> set[str]:
    """The modules reachable from ``modules`` (themselves included)."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def code_version(*modules: str, extra: Iterable[Path] = (), root: Path | None = None,
                 package: str = "predictors") -> str:
    """Hash of the source of every module of ``package`` (default: this one, at ``root``) the
    given ones can import, and of the ``extra`` files: the key of a cache of what those modules
    compute."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    files = _module_files(root, package)
    h = hashlib.sha256()
    for name in sorted(closure(import_graph(root, package), modules)):
        h.update(name.encode())
        h.update(files[name].read_bytes())
    for path in extra:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]
