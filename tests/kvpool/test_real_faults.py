"""Real device faults: errnos injected by the C++ core's fault wrapper (``KVPOOL_FAULTS`` /
``_kvio.set_faults``, a test-only build flag) reach the device's completion path, the handler
and the engine as a failing disk's would. Mid-load EIO, mid-save EIO (data or index record), a
full device (ENOSPC) and a SIGKILL while saving through faults: no wrong KV is ever served, no
committed index is lost, the bad chunks are counted and reported, the device comes back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from tests.kvpool.test_crash_points import check_after_restart  # noqa: E402
from vllm_kvpool.local import LocalPool  # noqa: E402
from vllm_kvpool.native import kvio  # noqa: E402

pytestmark = pytest.mark.skipif(
    not kvio().fault_injection(),
    reason="vllm_kvpool._kvio built without fault injection (test builds pass "
    "-DKVPOOL_FAULT_INJECTION=ON: scripts/bootstrap.sh, make cpptest)")  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
BLOCKS, BLOCK, BPC = 64, 16, 4  # 16 chunks of 4 blocks (48 KiB)
IDS = list(range(BLOCKS))


def hashes(tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]


def content(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BLOCK, 32, generator=g) for i in range(3)}


def config(tmp: Path, ssds: int = 1, host: bool = True, retry: float = 0.05) -> dict:
    devices = [{"host": {"capacity": "256KiB", "bandwidth_gbps": 1.0}}] if host else []
    devices += [{"ssd": {"path": str(tmp / f"s{i}.kvpool"), "capacity": "1MiB",
                         "bandwidth_gbps": 1.0}} for i in range(ssds)]  # fmt: skip
    return {"chunk_tokens": BPC * BLOCK, "device_retry_seconds": retry, "devices": devices}


def open_pool(cfg: dict, kv: dict[str, torch.Tensor]) -> LocalPool:
    # Bandwidths given: no probe I/O counts against the rules.
    return LocalPool(cfg, kv, BLOCKS, BLOCK, bandwidths=[1.0] * len(cfg["devices"]))


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv("KVPOOL_FAULTS", raising=False)
    kvio().set_faults("")
    yield
    kvio().set_faults("")


def fill(kv: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    for k, t in kv.items():
        t.copy_(src[k])


def fetch(pool: LocalPool, kv: dict[str, torch.Tensor], keys: list[bytes],
          invalid: set[int] | None = None):  # fmt: skip
    """Zero the KV, fetch ``keys`` into blocks 0.. ; ``invalid`` collects the blocks the
    engine reported not loaded (vLLM would recompute them)."""
    for t in kv.values():
        t.zero_()
    if invalid is not None:
        take = pool.engine.take_invalid_blocks

        def spy() -> set[int]:
            out = take()
            invalid.update(out)
            return out

        pool.engine.take_invalid_blocks = spy  # type: ignore[method-assign]
    try:
        return pool.fetch(keys, IDS[: len(keys)])
    finally:
        if invalid is not None:
            del pool.engine.take_invalid_blocks


def same(kv, want, blocks) -> bool:
    idx = torch.tensor(sorted(blocks), dtype=torch.long)
    return all(torch.equal(kv[k][idx], want[k][idx]) for k in kv)


def first_blocks(pool: LocalPool, name: str, keys: list[bytes]) -> list[int]:
    """First block of every chunk of ``keys`` the index holds on device ``name``."""
    dev = [d.name for d in pool.config.devices].index(name)
    return sorted(keys.index(e.key) for e in pool.pool.index.entries.values()
                  if e.location.device == dev and e.key in keys)  # fmt: skip


def usage(pool: LocalPool, name: str):
    return next(u for u in pool.status().usage if u.name == name)


def wait_recovered(pool: LocalPool, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while usage(pool, name).failed:  # status() retries failed media (on the reaper thread)
        assert time.monotonic() < deadline, f"{name} did not come back"
        pool.engine.wait_all()
        time.sleep(0.02)


def test_eio_mid_load_fails_that_chunk_only_then_the_device_recovers(tmp_path):
    kv, want = content(0), content(0)
    keys = hashes("load")
    with open_pool(config(tmp_path), kv) as pool:
        assert pool.save(keys, IDS) == 16
        on_ssd = first_blocks(pool, "ssd0", keys)
        assert len(on_ssd) >= 3
        kvio().set_faults("device=ssd0,op=read,errno=EIO,after=1,count=1")
        invalid: set[int] = set()
        r = fetch(pool, kv, keys, invalid)
        bad = on_ssd[1]  # the SSD's second read fails, its others and the host's succeed
        assert not r.ok and r.blocks == BLOCKS
        assert invalid == set(range(bad, bad + BPC))
        assert same(kv, want, set(IDS) - invalid)
        assert not same(kv, want, invalid)  # the failed read's bytes were never taken
        handler = pool.handlers[1]
        assert handler.failed and handler.device.stats()["errors"] == 1
        assert "injected fault" in handler.failure and "Input/output error" in handler.failure
        assert kvio().faults_injected() == 1
        status = pool.status()
        assert status.transfers.devices["ssd0"].errors >= 1
        assert status.transfers.devices["host0"].errors == 0
        assert usage(pool, "ssd0").failed
        # Its chunks are misses now: the prefix ends at the SSD's first chunk, served verified.
        hits = pool.pool.lookup(keys)
        assert sum(h.num_blocks for h in hits) == on_ssd[0]
        r = fetch(pool, kv, keys)
        assert r.ok and r.blocks == on_ssd[0] and same(kv, want, range(on_ssd[0]))
        # The rule is spent: the retry's probe works, the device takes and serves chunks again.
        wait_recovered(pool, "ssd0")
        again, want2 = hashes("again"), content(1)
        fill(kv, want2)
        assert pool.save(again, IDS) == 16 and first_blocks(pool, "ssd0", again)
        read_before = pool.status().transfers.devices["ssd0"].chunks_read
        r = fetch(pool, kv, again)
        assert r.ok and r.blocks == BLOCKS and same(kv, want2, IDS)
        assert pool.status().transfers.devices["ssd0"].chunks_read > read_before


@pytest.mark.parametrize("phase", ["data", "record"])
def test_eio_mid_save_never_indexes_the_chunk(tmp_path, phase):
    """One save of 16 chunks writes 16 chunk ops then their 16 index records: EIO on the third
    chunk's data or on its record. The chunk is never a hit in this life; after a restart only
    chunks whose record is on the medium come back, each byte-identical."""
    kv, want = content(2), content(2)
    keys = hashes("save")
    cfg = config(tmp_path, host=False)
    after = 2 if phase == "data" else 16 + 2
    with open_pool(cfg, kv) as pool:
        kvio().set_faults(f"device=ssd0,op=write,errno=EIO,after={after},count=1")
        committed = pool.save(keys, IDS)
        assert committed == 15 and kvio().faults_injected() == 1
        assert pool.pool.index.get(keys[2 * BPC]) is None
        assert pool.handlers[0].failed and usage(pool, "ssd0").failed
        assert pool.status().transfers.devices["ssd0"].errors >= 1
        assert pool.status().lookups.invalidated >= 1
        r = fetch(pool, kv, keys)
        assert r.ok and r.blocks == 0  # the failed device's chunks are misses, never served
        wait_recovered(pool, "ssd0")
    kv = {k: torch.zeros_like(t) for k, t in kv.items()}
    with open_pool(cfg, kv) as pool:  # a restart over the same file
        restored = {keys.index(e.key) for e in pool.pool.index.entries.values()}
        good = set(range(0, BLOCKS, BPC)) - {2 * BPC}
        if phase == "data":  # no record follows failed data
            assert restored == good
        else:  # the record write failed after the medium took it: it describes durable data
            assert good <= restored
        r = fetch(pool, kv, keys)
        served = r.blocks
        assert r.ok and served == (BLOCKS if 2 * BPC in restored else 2 * BPC)
        assert same(kv, want, range(served))
        r = fetch(pool, kv, keys[3 * BPC :])  # the chunks after the hole, alone
        assert r.ok and r.blocks == BLOCKS - 3 * BPC
        assert same({k: t[: BLOCKS - 3 * BPC] for k, t in kv.items()},
                    {k: t[3 * BPC :] for k, t in want.items()}, range(BLOCKS - 3 * BPC))  # fmt: skip
        assert pool.pool.lookups.invalidated == 0


def test_full_device_fails_saves_cleanly_the_pool_serves_from_the_others(tmp_path):
    """ssd1 answers every write with ENOSPC: its chunks' saves fail and nothing reaches it, it
    stays failed while full (its retries fail too), the host and ssd0 keep taking and serving
    chunks; once it has room again it comes back."""
    kv, want = content(3), content(3)
    keys = hashes("full")
    cfg = config(tmp_path, ssds=2)
    with open_pool(cfg, kv) as pool:
        kvio().set_faults("device=ssd1,op=write,errno=ENOSPC")
        committed = pool.save(keys, IDS)
        refused = kvio().faults_injected()
        assert refused >= 1 and committed == 16 - refused
        assert not first_blocks(pool, "ssd1", keys)
        dev = pool.handlers[2].device
        assert dev.stats()["bytes_written"] == 0 and dev.stats()["errors"] == refused
        data_bytes = pool.handlers[2].num_slots * pool.handlers[2].slot_bytes
        assert not any((tmp_path / "s1.kvpool").read_bytes()[:data_bytes])  # nothing landed
        status = pool.status()
        assert status.transfers.devices["ssd1"].errors >= 1 and usage(pool, "ssd1").failed
        # Served: the stored prefix (up to the first refused chunk), byte-identical.
        prefix = sum(h.num_blocks for h in pool.pool.lookup(keys))
        assert prefix < BLOCKS
        r = fetch(pool, kv, keys)
        assert r.ok and r.blocks == prefix and same(kv, want, range(prefix))
        # Still full: the retries' probes are refused and it stays out (polled until a retry
        # ran: a fixed 0.5 s could pass without one on a starved machine).
        deadline = time.monotonic() + 120
        while kvio().faults_injected() <= refused:
            assert time.monotonic() < deadline, "ssd1 was never retried"
            pool.status()
            pool.engine.wait_all()
        assert usage(pool, "ssd1").failed
        more, want2 = hashes("more"), content(4)
        fill(kv, want2)
        assert pool.save(more, IDS) == 16 and not first_blocks(pool, "ssd1", more)
        r = fetch(pool, kv, more)
        assert r.ok and r.blocks == BLOCKS and same(kv, want2, IDS)
        # Room again: it comes back and takes chunks.
        kvio().set_faults("")
        wait_recovered(pool, "ssd1")
        last, want3 = hashes("last"), content(5)
        fill(kv, want3)
        assert pool.save(last, IDS) == 16 and first_blocks(pool, "ssd1", last)
        r = fetch(pool, kv, last)
        assert r.ok and r.blocks == BLOCKS and same(kv, want3, IDS)


def test_eio_mid_load_through_vllm_is_recomputed(tmp_path):
    """vLLM's real scheduler and the worker connector: a prefix saved over a host pool and two
    SSDs, then an injected EIO on one SSD read of the next request's load. vLLM recomputes the
    failed blocks (the KV is right), the device is failed and counted."""
    pytest.importorskip("vllm")
    from support.model import write_tiny_llama
    from tests.kvpool.test_connector import (
        PROMPT,
        build,
        expected,
        run_and_capture,
        save_first_request,
    )

    h = build(write_tiny_llama(tmp_path / "model"), tmp_path)
    save_first_request(h)
    pool = h.connector.pool
    assert any(e.location.device == 1 for e in pool.index.entries.values())
    kvio().set_faults("device=ssd0,op=read,errno=EIO,count=1")
    _, final = run_and_capture(h, "B", PROMPT + [5, 6], 20)
    assert kvio().faults_injected() == 1
    assert pool.transfers.devices["ssd0"].errors >= 1 and pool.weights.failed[1]
    assert all(e.location.device != 1 for e in pool.index.entries.values())
    want = expected(h, PROMPT, 20)
    for name in h.kv:
        assert torch.equal(final[name], want[name]), name
    h.drain()


# A child saving rounds through injected write faults on both SSDs (the crash-point suite's
# pool: io_uring + posix, slots reused after ~11 rounds) logs every planned slot, every
# committed chunk and, per round, what was injected and counted; the parent SIGKILLs it.
CHILD = r'''
import json, os, sys
import torch
sys.path.insert(0, {tests!r})
from test_crash_points import BLOCKS, BLOCK, LAYOUT, config, content, hashes_of
from vllm_kvpool.local import LocalPool
from vllm_kvpool.native import kvio
from vllm_kvpool.pool import UnifiedPool

log = os.open({log!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def note(**event):
    os.write(log, (json.dumps(event) + "\n").encode())

plan_saves = UnifiedPool.plan_saves
def plan_saves_(self, req_id, chunks):
    planned = plan_saves(self, req_id, chunks)
    for p in planned:
        loc = p.entry.location
        note(event="plan", key=p.entry.key.decode(), device=loc.device, slot=loc.slot)
    return planned
UnifiedPool.plan_saves = plan_saves_

kv = {{f"l{{i}}": torch.empty(BLOCKS, 2, BLOCK, 32) for i in range(2)}}
with LocalPool(config({tmp!r}), kv, BLOCKS, BLOCK, bandwidths=[2.0, 2.0], layout_id=LAYOUT) as pool:
    for round_ in range(100_000):
        hashes = hashes_of(round_)
        for k, t in kv.items():
            t.copy_(content(round_, k))
        committed = pool.save(hashes, list(range(BLOCKS)))
        for h in hashes[:: BLOCKS // 12]:
            e = pool.pool.index.get(h)
            if e is not None and e.committed:
                note(event="commit", key=h.decode(), device=e.location.device, slot=e.location.slot)
        status = pool.status()
        note(event="round", round=round_, failed=12 - committed, injected=kvio().faults_injected(),
             errors={{n: c.errors for n, c in status.transfers.devices.items()}},
             invalidated=status.lookups.invalidated)
'''

# EIO on data and records of both SSDs, a full ssd1 once: 5 injected faults in all.
SOAK_FAULTS = ("device=ssd0,op=write,errno=EIO,after=30,count=2;"
               "device=ssd1,op=write,errno=EIO,after=60,count=1;"
               "device=ssd1,op=write,errno=ENOSPC,after=150,count=1;"
               "device=ssd0,op=write,errno=EIO,after=300,count=1")  # fmt: skip


def test_sigkill_while_saving_through_faults_then_restart(tmp_path):
    """No wrong KV, no lost index: after the kill every visible chunk verifies and holds its
    bytes, every committed chunk whose slot was not handed out again is there; before it, every
    injected fault was counted (device errors, invalidated chunks)."""
    log = tmp_path / "events.jsonl"
    script = CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), log=str(log))
    err = tmp_path / "child.err"
    with err.open("wb") as sink:
        child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=sink,
                                 env={**os.environ, "KVPOOL_FAULTS": SOAK_FAULTS})  # fmt: skip
    rounds: list[dict] = []
    try:
        deadline = time.monotonic() + 300
        while True:  # all 5 faults injected, slots reused, 3 more rounds: then kill mid-save
            rounds = [e for e in map(json.loads, log.read_text().splitlines())
                      if e["event"] == "round"] if log.exists() else []  # fmt: skip
            done = [r for r in rounds if r["injected"] >= 5]
            if len(done) >= 3 and len(rounds) >= 15:
                break
            assert child.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"faults not all injected: {rounds[-1:]}"
            time.sleep(0.05)
        time.sleep(0.03)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    last = rounds[-1]
    assert last["injected"] == 5
    assert last["errors"]["ssd0"] >= 1 and last["errors"]["ssd1"] >= 1
    assert sum(r["failed"] for r in rounds) >= 1 and last["invalidated"] >= 1
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert check_after_restart(tmp_path, events) >= 12
