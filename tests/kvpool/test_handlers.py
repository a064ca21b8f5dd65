"""Every medium behind the one save / load / poll interface: bytes round-trip, checksums,
corruption, staging back-pressure, and a device that fails and comes back."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.config import parse_pool_config  # noqa: E402
from vllm_kvpool.handlers import LoadOp, SaveOp, open_handler  # noqa: E402
from vllm_kvpool.layout import ChunkLayout  # noqa: E402
from vllm_kvpool.native import kvio  # noqa: E402

GEOMETRY = ChunkLayout.uniform(16 << 10, 4, layout_version=1)  # 64 KiB
SLOTS = 6
SPDK_TRID = os.environ.get("KVPOOL_SPDK_TRID", "")


def spdk_skip_reason() -> str | None:
    if "spdk" not in kvio().backends():
        return "module built without SPDK (pkg-config found no spdk_nvme/spdk_env_dpdk)"
    if not SPDK_TRID:
        return "KVPOOL_SPDK_TRID is not set (see docs/kvio-spdk.md)"
    if "trtype:TCP" in SPDK_TRID:
        addr, port = re.search(r"traddr:(\S+)", SPDK_TRID), re.search(r"trsvcid:(\d+)", SPDK_TRID)
        try:
            socket.create_connection((addr.group(1), int(port.group(1))), timeout=2).close()
        except (OSError, AttributeError) as exc:
            return f"NVMe/TCP target in KVPOOL_SPDK_TRID unreachable: {exc}"
    return None


def device(kind: str, tmp_path) -> dict:
    cap = SLOTS * GEOMETRY.slot_bytes
    if kind == "host":
        return {"host": {"capacity": cap}}
    if kind == "spdk":
        return {"ssd": {"path": "nvme-test", "backend": "spdk", "spdk_trid": SPDK_TRID,
                        "capacity": cap}}  # fmt: skip
    return {"ssd": {"path": str(tmp_path / f"{kind}.kvpool"), "backend": kind, "capacity": cap}}


def make(kind: str, tmp_path, staging_slots: int = 2):
    if kind == "spdk" and (reason := spdk_skip_reason()):
        pytest.skip(reason)
    config = parse_pool_config({"chunk_tokens": 64, "staging": staging_slots * GEOMETRY.slot_bytes,
                                "devices": [device(kind, tmp_path)]})  # fmt: skip
    return open_handler(config.devices[0], config, GEOMETRY)


def chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (GEOMETRY.chunk_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip


def save(h, slot: int, data: torch.Tensor) -> int:
    buf = h.save_buffer(slot, data.numel())
    buf.view.copy_(data)
    ticket = h.submit_save([SaveOp(slot, buf.address, data.numel())])
    (out,) = h.wait(ticket)
    buf.release()
    assert out.ok, out.message
    assert out.checksum == kvio().checksum(data.numpy())
    return out.checksum


def load(h, slot: int, expected: int | None):
    target = h.load_buffer(slot, GEOMETRY.chunk_bytes)
    ticket = h.submit_load([LoadOp(slot, target.address, GEOMETRY.chunk_bytes, expected)])
    while not h.poll(ticket):
        pass
    (out,) = h.wait(ticket)
    data = target.view.clone()
    target.release()
    return out, data


@pytest.mark.parametrize("kind", ["host", "uring", "posix", "spdk"])
def test_round_trip_and_corruption(kind, tmp_path):
    h = make(kind, tmp_path)
    try:
        sums = {slot: save(h, slot, chunk(slot)) for slot in (0, 3, 5)}
        for slot, checksum in sums.items():
            out, data = load(h, slot, checksum)
            assert out.ok and out.status == "ok"
            assert torch.equal(data, chunk(slot))
        out, _ = load(h, 3, sums[3] ^ 1)  # a wrong expectation is reported, never returned as ok
        assert not out.ok and out.status == "corrupt"
    finally:
        h.close()


@pytest.mark.parametrize("kind", ["uring", "posix"])
def test_staging_back_pressure_and_spill(kind, tmp_path):
    h = make(kind, tmp_path, staging_slots=2)
    try:
        # (the staging pool is rounded up to 2 MiB: 32 slots of 64 KiB)
        held = [h.load_buffer(0, GEOMETRY.chunk_bytes) for _ in range(h.staging_slots)]
        assert all(b is not None for b in held)
        assert h.load_buffer(0, GEOMETRY.chunk_bytes) is None  # busy: the engine retries later
        save(h, 1, chunk(7))  # saves never wait for staging: a private buffer is used
        held.pop().release()
        out, data = load(h, 1, None)
        assert out.ok and torch.equal(data, chunk(7))
        for b in held:
            b.release()
    finally:
        h.close()


def test_device_fails_and_comes_back(tmp_path):
    h = make("uring", tmp_path)
    path = tmp_path / "uring.kvpool"
    try:
        checksum = save(h, 2, chunk(2))
        size = path.stat().st_size
        os.truncate(path, 0)  # the file loses its data: reads now end early
        out, _ = load(h, 2, checksum)
        assert not out.ok and out.status == "error" and "short read" in out.message
        assert h.mark_failed(out.message) and not h.mark_failed("again") and h.failed
        os.truncate(path, size)
        assert h.try_recover() and not h.failed  # reopened, scratch round trip checked
        checksum = save(h, 2, chunk(9))
        out, data = load(h, 2, checksum)
        assert out.ok and torch.equal(data, chunk(9))
    finally:
        h.close()


def test_local_pool_saves_and_fetches_byte_identical(tmp_path):
    from vllm_kvpool.local import LocalPool

    blocks = 32
    kv = {f"l{i}": torch.randn(blocks, 2, 16, 32, generator=torch.Generator().manual_seed(i))
          for i in range(2)}  # fmt: skip
    want = {k: t.clone() for k, t in kv.items()}
    config = {"chunk_tokens": 64, "devices": [
        {"host": {"capacity": "64KiB", "bandwidth_gbps": 4.0}},
        {"ssd": {"path": str(tmp_path / "s.kvpool"), "capacity": "1MiB", "bandwidth_gbps": 1.0}}]}
    hashes = [f"b{i}".encode() for i in range(blocks)]
    with LocalPool(config, kv, blocks, block_size=16) as pool:
        assert pool.save(hashes, list(range(blocks))) == 8
        for t in kv.values():
            t.zero_()
        result = pool.fetch(hashes, list(range(blocks)))
        assert result.ok and result.blocks == blocks
        devices = pool.status().transfers.devices
        assert devices["host0"].bytes_read > 0 and devices["ssd0"].bytes_read > 0
    for k in kv:
        assert torch.equal(kv[k], want[k])


def test_pool_stops_using_a_failed_device_and_takes_it_back(tmp_path):
    """Engine + pool: a device whose reads fail is marked failed (its chunks become misses, no
    new chunks go there); once it can be reopened it is retried and placed on again."""
    from vllm_kvpool.local import LocalPool

    blocks = 32
    kv = {"l0": torch.randn(blocks, 2, 16, 32, generator=torch.Generator().manual_seed(0))}
    path = tmp_path / "s1.kvpool"
    # Retry on every report: each ``status()`` below starts one retry on the reaper thread and
    # ``wait_all`` waits for it, so the test does not depend on how busy the machine is.
    config = {"chunk_tokens": 64, "device_retry_seconds": 1e-6, "devices": [
        {"ssd": {"path": str(tmp_path / "s0.kvpool"), "capacity": "1MiB", "bandwidth_gbps": 1.0}},
        {"ssd": {"path": str(path), "capacity": "1MiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip
    with LocalPool(config, kv, blocks, block_size=16) as pool:
        first = [f"a{i}".encode() for i in range(blocks)]
        assert pool.save(first, list(range(blocks))) == 8
        size = path.stat().st_size
        os.rename(path, tmp_path / "away")  # detached: reopening fails...
        os.truncate(tmp_path / "away", 0)  # ...and reads of the open file end early
        result = pool.fetch(first, list(range(blocks)))
        assert not result.ok and pool.pool.weights.failed[1]
        assert all(e.location.device == 0 for e in pool.pool.index.entries.values())
        second = [f"b{i}".encode() for i in range(blocks)]
        pool.save(second, list(range(blocks)))
        assert all(e.location.device == 0 for e in pool.pool.index.entries.values())
        pool.status()  # a retry while still detached fails: the device stays out
        pool.engine.wait_all()
        pool.status()
        assert pool.pool.weights.failed[1]
        os.truncate(tmp_path / "away", size)
        os.rename(tmp_path / "away", path)  # reattached
        pool.status()  # the retry that finds it back...
        pool.engine.wait_all()
        pool.status()  # ...and the report that says so
        assert not pool.pool.weights.failed[1]
        third = [f"c{i}".encode() for i in range(blocks)]
        assert pool.save(third, list(range(blocks))) > 0
        assert any(e.location.device == 1 for e in pool.pool.index.entries.values())
        want = kv["l0"].clone()
        kv["l0"].zero_()
        got = pool.fetch(third, list(range(blocks)))
        assert got.ok and got.blocks == blocks and torch.equal(kv["l0"], want)
