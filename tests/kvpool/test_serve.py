"""`kvpool serve` (vLLM's own `serve` CLI) with `--kv-transfer-config` on 127.0.0.1: one real
HTTP completion request."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.model import write_tiny_llama  # noqa: E402
from support.serving import Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_vllm_serve_answers_a_completion(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny-llama")
    pool = {"chunk_tokens": 64, "devices": [
        {"host": {"capacity": "4MiB"}},
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "16MiB", "backend": "uring"}}],
        "probe": {"seconds": 0.1, "size": "8MiB"}}  # fmt: skip
    server = Server("kvpool serve", model, tmp_path / "serve.log", pool=pool,
                    status_file=tmp_path / "status.json",
                    flags=["--max-model-len", "2048", "--gpu-memory-utilization", "0.3",
                           "--kv-cache-memory-bytes", str(256 << 20)])  # fmt: skip
    server.start()
    try:
        server.wait_ready(timeout=600)  # slow start-up under CPU contention
        body = json.dumps({"model": str(model), "prompt": "the unified pool " * 40,
                           "max_tokens": 4, "temperature": 0}).encode()  # fmt: skip
        req = urllib.request.Request(server.url("/v1/completions"), data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 4
        assert isinstance(reply["choices"][0]["text"], str)
    finally:
        server.stop()
