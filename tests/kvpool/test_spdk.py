"""A pool with an SPDK device against a real NVMe/TCP target (SPDK's nvmf_tgt on loopback): the
handler's recovery across a target restart, and `kvpool serve` with greedy outputs equal to a
no-connector server while the target is SIGKILLed and restarted mid-run (misses, then hits
again, never wrong bytes).

SPDK is in no package registry, so these tests skip in CI; `make spdk-check SPDK_DIR=...` runs
them against an SPDK built as docs/kvio-spdk.md says. Each test starts its own target with
`scripts/spdk_nvmf_target.sh` (its own state dir and port) and stops it.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.native import kvio  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "spdk_nvmf_target.sh"
pytestmark = [pytest.mark.slow, pytest.mark.spdk]


def skip_reason() -> str | None:
    if "spdk" not in kvio().backends():
        return "module built without SPDK (pkg-config found no spdk_nvme; see docs/kvio-spdk.md)"
    if not os.environ.get("SPDK_DIR"):
        return "SPDK_DIR is not set (the SPDK install with bin/nvmf_tgt; `make spdk-check`)"
    if os.geteuid() != 0:
        return "the NVMe/TCP target needs root (huge pages)"
    return None


class Target:
    """One nvmf_tgt over a RAM bdev, driven by scripts/spdk_nvmf_target.sh."""

    def __init__(self, state: Path, port: int) -> None:
        self.log = state / "nvmf_tgt.log"
        self.env = {**os.environ, "KVPOOL_TGT_DIR": str(state), "KVPOOL_TGT_PORT": str(port),
                    "KVPOOL_TGT_MALLOC_MIB": "256"}  # fmt: skip
        self.trid = ""

    def _run(self, action: str) -> str:
        out = subprocess.run(["bash", str(SCRIPT), action], env=self.env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        log = self.log.read_text()[-2000:] if self.log.exists() else ""
        assert out.returncode == 0, f"{action}: {out.stdout}{out.stderr}\n{log}"
        return out.stdout.strip()

    def start(self) -> None:
        self.trid = self._run("start").splitlines()[-1]

    def kill(self) -> None:
        self._run("kill")


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    if reason := skip_reason():
        pytest.skip(reason)
    t = Target(tmp_path / "tgt", 4431)
    t.start()
    try:
        yield t
    finally:
        t.kill()


def _kv(seed: int, blocks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(blocks, 2, 16, 32, generator=g) for i in range(2)}


def _round_trip(pool, hashes: list[bytes], ids: list[int], kv: dict, want: dict) -> None:
    """Save the KV (equal to ``want``), zero it, fetch it back: byte for byte."""
    assert pool.save(hashes, ids) == len(ids) // 4
    for t in kv.values():
        t.zero_()
    r = pool.fetch(hashes, ids)
    assert r.ok and r.blocks == len(ids)
    assert all(torch.equal(kv[k], want[k]) for k in kv)


def test_spdk_device_recovers_after_the_target_restarts(tmp_path, target):
    """Save to the SPDK device, SIGKILL the target: loads fail and are reported (never wrong
    bytes), the device is marked failed and its chunks become misses; once the target is back
    the engine's retry (``try_recover`` against the real target) brings it back and it serves
    new chunks byte for byte."""
    from vllm_kvpool.local import LocalPool

    blocks = 32
    config = {"chunk_tokens": 64, "device_retry_seconds": 0.2, "verify_checksums": True,
              "devices": [{"ssd": {"name": "spdk0", "path": "spdk0", "backend": "spdk",
                                   "spdk_trid": target.trid, "capacity": "32MiB",
                                   "bandwidth_gbps": 1.0}}]}  # fmt: skip
    hashes = [f"spdk-{i}".encode() for i in range(blocks)]
    ids = list(range(blocks))
    kv = _kv(0, blocks)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(config, kv, blocks, 16) as pool:
        _round_trip(pool, hashes, ids, kv, want)

        target.kill()
        for t in kv.values():
            t.fill_(7.0)
        r = pool.fetch(hashes, ids, timeout=120)
        assert not r.ok  # every chunk's read failed and was reported, none served
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in kv.values())
        status = pool.status()
        assert status.usage[0].failed and status.transfers.devices["spdk0"].errors >= 1
        assert pool.fetch(hashes, ids).blocks == 0  # its chunks are misses now
        assert not pool.handlers[0].try_recover()  # the target is still down

        target.start()
        deadline = time.monotonic() + 120
        while pool.status().usage[0].failed:  # the engine's retry reconnects
            assert time.monotonic() < deadline, "the SPDK device never came back"
            time.sleep(0.2)
        kv2 = _kv(1, blocks)
        for k in kv:
            kv[k].copy_(kv2[k])
        _round_trip(pool, [f"spdk-again-{i}".encode() for i in range(blocks)], ids, kv, kv2)


def _threads_named(name: str) -> list[Path]:
    return [t for t in Path("/proc/self/task").iterdir()
            if (t / "comm").read_text().strip() == name]  # fmt: skip


def test_poller_pinned_to_its_mask_and_the_caller_left_alone(target):
    """The controller's poller runs on ``spdk_core_mask`` (what bench_kvio gives it: the cores
    spdk_nvme_perf polls on); the thread that opened the device keeps its own affinity."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    with kvio().Device(target.trid, backend="spdk", name="pin-test",
                       spdk_core_mask=hex(1 << cpu)) as dev:  # fmt: skip
        assert dev.capacity > 0
        pollers = _threads_named("kvio-spdk-poll")
        assert pollers, "no SPDK poller thread"
        allowed = [os.sched_getaffinity(int(t.name)) for t in pollers]
        assert {cpu} in allowed, allowed
        assert os.sched_getaffinity(0) == before


def _pci_opens(trid: str, tmp: Path, **env: str) -> list[str]:
    """The PCI sysfs paths a fresh process opens while it opens its first SPDK device (strace)."""
    trace = tmp / f"strace-{len(env)}.txt"
    code = ("from vllm_kvpool.native import kvio; import sys\n"
            "with kvio().Device(sys.argv[1], backend='spdk', name='pci-test') as d:\n"
            "    assert d.capacity > 0")  # fmt: skip
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat", "-o", str(trace),
                    sys.executable, "-c", code, trid], env={**os.environ, **env}, cwd=REPO,
                   check=True, timeout=120)  # fmt: skip
    return [line for line in trace.read_text().splitlines() if "/sys/bus/pci" in line]


def test_nvmf_only_process_skips_the_pci_scan(tmp_path, target):
    """A process whose first SPDK device is NVMe-oF does not scan the PCI bus (DPDK would probe
    every PCI device it has a driver for); ``KVPOOL_SPDK_PCI=1`` turns the scan back on, which
    is what shows the strace sees a scan when there is one."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    assert _pci_opens(target.trid, tmp_path) == []
    assert _pci_opens(target.trid, tmp_path, KVPOOL_SPDK_PCI="1"), "the control run saw no scan"


# ----------------------------------------------------------------------------- kvpool serve
MAX_TOKENS = 8


def _complete(port: int, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    return list(json.loads(resp.read())["choices"][0]["token_ids"])


def _spdk_read(server) -> int:
    """Bytes read from the SPDK device so far, from the status file after one more engine step
    (the scheduler rewrites it at most once a second, from a step)."""
    time.sleep(1.1)
    _complete(server.port, [5, 6, 7, 8])
    return server.status().get("transfers", {}).get("devices", {}).get("spdk0", {}).get(
        "bytes_read", 0)


def test_kvpool_serve_with_an_spdk_device_through_a_target_restart(tmp_path, target):
    pytest.importorskip("vllm")
    from support.model import write_tiny_llama
    from support.serving import Server

    model = write_tiny_llama(tmp_path / "tiny-llama")
    flags = ["--max-model-len", "2048", "--max-num-seqs", "4", "--no-enable-prefix-caching",
             "--served-model-name", "m", "--kv-cache-memory-bytes", str(256 << 20)]  # fmt: skip
    pool = {"chunk_tokens": 64, "device_retry_seconds": 1.0, "probe": {"enabled": False},
            "devices": [{"host": {"capacity": "1MiB"}},
                        {"ssd": {"name": "spdk0", "path": "spdk0", "backend": "spdk",
                                 "spdk_trid": target.trid, "capacity": "64MiB"}}]}  # fmt: skip
    served = Server("kvpool serve", model, tmp_path / "pool.log", flags=flags, pool=pool,
                    status_file=tmp_path / "status.json")  # fmt: skip
    reference = Server("reference", model, tmp_path / "ref.log", flags=flags)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (640,), generator=rng).tolist() for _ in range(3)]
    answers: dict[int, list[int]] = {}
    try:
        reference.start()
        reference.wait_ready()
        for i, p in enumerate(prompts):
            answers[i] = _complete(reference.port, p)
        reference.stop()

        served.start()
        served.wait_ready()
        for i, p in enumerate(prompts):  # saved: most chunks land on the SPDK device
            assert _complete(served.port, p) == answers[i]
        for i, p in enumerate(prompts):  # hits, read back from the target
            assert _complete(served.port, p) == answers[i]
        before = _spdk_read(served)
        assert before > 0, served.status()

        target.kill()  # mid-run: misses (recomputed), never wrong bytes, the server serves on
        for i, p in enumerate(prompts):
            assert _complete(served.port, p) == answers[i]

        target.start()  # back, empty: the device is checked and takes new chunks again
        deadline = time.monotonic() + 180
        while True:
            for i, p in enumerate(prompts):
                assert _complete(served.port, p) == answers[i]
            if _spdk_read(served) > before:  # hits from the target again
                break
            assert time.monotonic() < deadline, served.status()
    finally:
        served.stop()
        reference.stop()
