"""The memory benchmark loaded as a module, for tests of its scoring (it lives outside the
installed package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def memory_bench() -> ModuleType:
    name = "bench_memory_predictor"
    if name not in sys.modules:  # dataclasses resolve their module through sys.modules
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "benchmarks" / "bench_memory_predictor.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
