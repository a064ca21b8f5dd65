"""The SPDK docs' command block (docs/kvio-spdk.md, "as written:") holds together without SPDK:
what `scripts/spdk_docs_check.py` runs where SPDK is built. The paths it names exist, the flags it
passes are the tools' own, the benchmark's size fits the target it starts, and the module rebuild
keeps the test build's fault injection (else `make test` under CI=true stops at exit 3)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from spdk_docs_check import command_block, runnable  # noqa: E402


def _commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip


def test_the_block_names_paths_that_exist_and_binds_its_placeholders():
    block = command_block()
    for rel in set(re.findall(r"\b((?:scripts|tests|benchmarks)/[\w./-]+)", block)):
        assert (ROOT / rel).exists(), rel
    bound = runnable(block, "/opt/spdk", "/venv/bin/python")
    assert "<spdk-prefix>" not in bound and "/opt/spdk/bin/spdk_nvme_perf" in bound
    assert not re.search(r"(?m)^\s*(python|pip) ", bound)
    usage = (ROOT / "scripts" / "spdk_nvmf_target.sh").read_text()
    for sub in re.findall(r"spdk_nvmf_target\.sh (\w+)", block):
        assert f"{sub})" in usage or f"| {sub}" in usage or f"{sub} |" in usage, sub


def test_the_rebuild_keeps_fault_injection():
    rebuilds = [c for c in _commands(command_block()) if "pip install" in c and "-e ." in c]
    assert rebuilds
    for cmd in rebuilds:
        assert "-DKVPOOL_FAULT_INJECTION=ON" in cmd and "-DKVPOOL_WITH_SPDK=ON" in cmd, cmd


def test_the_benchmark_flags_and_size_agree_with_its_help():
    cmds = _commands(command_block())
    malloc_mib = next(int(c.split("=")[1]) for c in cmds if "KVPOOL_TGT_MALLOC_MIB=" in c)
    help_text = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kvio.py"),
                                "--help"], capture_output=True, text=True, check=True,
                               cwd=ROOT).stdout  # fmt: skip
    assert ">= 2" not in help_text  # the docs use 1.5
    benches = [shlex.split(c) for c in cmds if "bench_kvio.py" in c]
    assert benches
    for argv in benches:
        for flag in (a for a in argv if a.startswith("--")):
            assert flag in help_text, flag
        size = float(argv[argv.index("--size-gib") + 1])
        assert 0 < size * 1024 <= malloc_mib, (size, malloc_mib)  # fits the RAM bdev started


def test_a_failing_block_still_kills_its_target(tmp_path, monkeypatch):
    """The block stops at its first failing line, before its own `stop`: the checker kills the
    target it left (here a process standing in for nvmf_tgt, in the target script's state dir)."""
    import spdk_docs_check

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvmf_tgt").write_text("")
    state = tmp_path / "tgt"
    state.mkdir()
    target = subprocess.Popen(["sleep", "60"])
    reaper = threading.Thread(target=target.wait)  # reaped at once, so `kill -0` sees it gone
    reaper.start()
    (state / "nvmf_tgt.pid").write_text(f"{target.pid}\n")
    monkeypatch.setenv("SPDK_DIR", str(tmp_path))
    monkeypatch.setenv("KVPOOL_TGT_DIR", str(state))
    monkeypatch.setattr(spdk_docs_check, "command_block", lambda: "false\n")
    try:
        assert spdk_docs_check.main([]) == 1
        reaper.join(timeout=15)
        assert target.returncode == -9  # SIGKILLed by `spdk_nvmf_target.sh release`
        assert not (state / "nvmf_tgt.pid").exists()
    finally:
        target.kill()
