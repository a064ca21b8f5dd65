"""`kvpool serve` (vLLM's own `serve` CLI) as a child process on 127.0.0.1, for the tests and
benchmarks: started, probed until healthy, stopped by its pid and its engine core's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32  # tokens per vLLM KV block, in every test and benchmark


def transfer_config(pool: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """vLLM's kv-transfer config for the pool connector; ``extra`` joins the pool config in
    ``kv_connector_extra_config`` (e.g. ``status_file``)."""
    return {"kv_connector": "UnifiedKVPoolConnector",
            "kv_connector_module_path": "vllm_kvpool.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"pool": pool, **extra}}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvpool_command() -> list[str]:
    """The installed ``kvpool`` console script beside this interpreter (else the same entry
    point through ``-m``)."""
    script = Path(sys.executable).with_name("kvpool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_kvpool.cli"]


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (vLLM's engine core and its helpers)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += [int(child), *descendants(int(child))]
    except OSError:
        pass
    return out


def become_subreaper() -> None:
    """Adopt the server's orphaned processes (vLLM's engine core), so that once reaped their
    CPU time counts as this run's (RUSAGE_CHILDREN, which quiet-run reads), not as others'."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux >= 3.4)


def reap_orphans(timeout: float = 60) -> None:
    """Wait for every adopted descendant to exit (they leave with their parent server).
    Reaps any child: call it with no other child process running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.1)


@dataclass
class Server:
    """One `kvpool serve` process; ``start`` again after ``stop`` restarts it on the same port,
    appending to the same log."""

    name: str
    model: Path
    log: Path
    flags: list[str] = field(default_factory=list)  # more `serve` flags
    pool: dict[str, Any] | None = None  # None: no connector
    status_file: Path | None = None  # the pool's status file
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    port: int = field(default_factory=free_port)
    kvpool: list[str] = field(default_factory=kvpool_command)  # the `kvpool` that serves
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [*self.kvpool, "serve", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--enforce-eager", "--seed", "0", *self.flags]  # fmt: skip
        if self.pool is not None:
            extra = {} if self.status_file is None else {"status_file": str(self.status_file)}
            cmd += ["--kv-transfer-config", json.dumps(transfer_config(self.pool, **extra))]
        return cmd

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip

    def wait_ready(self, timeout: float = 600) -> None:
        """Until ``/health`` answers; raises if the server exits or ``timeout`` s pass."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   f"{self.log.read_text()[-3000:]}")  # fmt: skip
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url("/health"), timeout=5):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s")
            time.sleep(1)

    def pids(self) -> list[int]:
        return [] if self.proc is None else [self.proc.pid, *descendants(self.proc.pid)]

    def stop(self) -> None:
        """SIGTERM the server by its pid (SIGKILL after 60 s), then SIGKILL by pid whatever of
        its engine core is left: a restart must not share the pool's files with it."""
        if self.proc is None:
            return
        pids = self.pids()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for pid in pids[1:]:  # its engine core, should it outlive the server
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def status(self) -> dict[str, Any]:
        """The pool's status file; {} without one or before its first write."""
        if self.status_file is not None:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(self.status_file.read_text())
        return {}
