"""Two `kvpool serve` instances on one node sharing one pool service: the first engine finds no
daemon and starts it, the second attaches; a prompt the first served is a pool hit for the
second (its chunks are the first's), and the second's greedy answer equals the first's, which
computed every token (the pool was empty)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.kvpool_node import daemon_pids, stop_daemons  # noqa: E402
from support.model import write_tiny_llama  # noqa: E402
from support.serving import Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def complete(server: Server, model, prompt: str) -> str:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()  # fmt: skip
    req = urllib.request.Request(server.url("/v1/completions"), data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def hit_tokens(server: Server, at_least: int, timeout: float = 30) -> int:
    """The node's hit tokens once the status file shows at least ``at_least``."""
    deadline = time.monotonic() + timeout
    while True:
        hits = server.status().get("lookups", {}).get("hit_tokens", -1)
        if hits >= at_least or time.monotonic() > deadline:
            return hits
        time.sleep(0.5)


def test_two_serve_instances_share_prefix_hits_through_one_daemon(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny-llama")
    sock = tmp_path / "run" / "pool.sock"
    pool = {"chunk_tokens": 64, "devices": [
        {"host": {"capacity": "4MiB", "bandwidth_gbps": 2.0}},
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "16MiB", "backend": "posix",
                 "bandwidth_gbps": 1.0}}],
        "staging": "4MiB", "service": {"socket": str(sock), "start_timeout": 120}}  # fmt: skip
    flags = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20)]
    servers = [Server(f"kvpool serve {i}", model, tmp_path / f"serve{i}.log", pool=pool,
                      status_file=tmp_path / f"status{i}.json", flags=flags)
               for i in range(2)]  # fmt: skip
    prompt = "one pool per node for every engine " * 20  # several chunks of 64 tokens
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=900)
        assert len(daemon_pids(sock)) == 1  # started by whichever engine came first
        first = complete(servers[0], model, prompt)  # computed: the pool is empty
        assert hit_tokens(servers[0], 0) == 0
        time.sleep(3)  # its saves commit (the engine keeps stepping until they are acked)
        second = complete(servers[1], model, prompt)
        assert hit_tokens(servers[1], 64) >= 64 * 4  # the first's chunks served the second
        assert second == first
    finally:
        for s in servers:
            s.stop()
        stop_daemons(sock)
