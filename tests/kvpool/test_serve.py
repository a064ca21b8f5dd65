"""`kvpool serve` (vLLM's own `serve` CLI) with `--kv-transfer-config` on 127.0.0.1: one real
HTTP completion request."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from tests.kvpool.vllm_harness import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvpool_command() -> list[str]:
    """The installed ``kvpool`` console script beside this interpreter (else the same entry
    point through ``-m``)."""
    script = Path(sys.executable).with_name("kvpool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_kvpool.cli"]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def test_vllm_serve_answers_a_completion(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny-llama")
    pool = {"chunk_tokens": 64, "devices": [
        {"host": {"capacity": "4MiB"}},
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "16MiB", "backend": "uring"}}],
        "probe": {"seconds": 0.1, "size": "8MiB"}}  # fmt: skip
    transfer = {"kv_connector": "UnifiedKVPoolConnector",
                "kv_connector_module_path": "vllm_kvpool.connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"pool": pool,
                                              "status_file": str(tmp_path / "status.json")}}  # fmt: skip
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [*kvpool_command(), "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--block-size", "32", "--enforce-eager", "--max-model-len", "2048",
           "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(256 << 20),
           "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 600  # slow start-up under CPU contention
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(1)
        body = json.dumps({"model": str(model), "prompt": "the unified pool " * 40,
                           "max_tokens": 4, "temperature": 0}).encode()  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 4
        assert isinstance(reply["choices"][0]["text"], str)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)  # stop exactly the server we started
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
