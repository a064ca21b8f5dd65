"""Random bytes survive device round trips on every backend compiled here."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import MiB

from vllm_kvpool import _kvio


@pytest.fixture(params=["uring-file", "uring-sqpoll-file", "uring-loop", "posix-tmpfs"])
def device(request: pytest.FixtureRequest, scratch: Path, shm_dir: Path) -> Iterator[_kvio.Device]:
    kind = request.param
    if kind == "uring-file":
        dev = _kvio.Device(str(scratch / "dev.img"), capacity=32 * MiB, backend="uring")
    elif kind == "uring-sqpoll-file":
        dev = _kvio.Device(str(scratch / "dev.img"), capacity=32 * MiB, sqpoll=True)
        assert dev.sqpoll or "SQPOLL unavailable" in dev.note
    elif kind == "uring-loop":
        loop = request.getfixturevalue("loop_device")
        dev = _kvio.Device(loop.path, backend="uring", name="loop")
        assert dev.kind == "block"
    else:
        dev = _kvio.Device(str(shm_dir / "dev.img"), capacity=32 * MiB, backend="posix")
    with dev:
        yield dev


def fill_random(pool: _kvio.HostPool, seed: int) -> np.ndarray:
    buf = np.frombuffer(pool, np.uint8)
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)
    return buf


def test_roundtrip_many_sizes_and_offsets(device: _kvio.Device, pool: _kvio.HostPool) -> None:
    buf = fill_random(pool, 1)
    device.register_host_pools([pool])
    rng = np.random.default_rng(2)
    g = max(device.alignment, 512)
    half = pool.capacity // 2
    writes, reads, expect = [], [], []
    dev_off, host_off = 0, 0
    # Lengths from one sector to 2 MiB; offsets packed back to back with random gaps.
    for _ in range(40):
        length = int(rng.integers(1, 2 * MiB // g + 1)) * g
        if dev_off + length > device.capacity or host_off + length > half:
            break
        writes.append((dev_off, pool.address + host_off, length))
        expect.append((host_off, length))
        dev_off += length + int(rng.integers(0, 8)) * g
        host_off += length
    results = device.write(writes)
    assert [r.status for r in results] == ["ok"] * len(writes)
    for r, (host, length) in zip(results, expect, strict=True):
        assert r.checksum == _kvio.checksum(pool.address + host, length)
    # Read everything back into the other half of the pool, in reverse order, verified.
    dst = half
    for (off, _, length), w in reversed(list(zip(writes, results, strict=True))):
        reads.append((off, pool.address + dst, length, w.checksum))
        dst += length
    results = device.read(reads)
    assert all(r.ok for r in results)
    for (_, addr, length, _), (host, elen) in zip(reads, reversed(expect), strict=True):
        got = buf[addr - pool.address : addr - pool.address + length]
        assert length == elen
        assert np.array_equal(got, buf[host : host + length])


def test_unregistered_numpy_buffer(device: _kvio.Device) -> None:
    """Buffers outside registered pools take the plain (non-fixed) path."""
    n = 3 * MiB
    raw = np.zeros(n + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    src = raw[start : start + n // 2]
    dst = raw[start + n // 2 : start + n]
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    [w] = device.write([(4 * MiB, src.ctypes.data, src.size)])
    [r] = device.read([(4 * MiB, dst.ctypes.data, dst.size, w.checksum)])
    assert r.ok and np.array_equal(src, dst)


def test_async_tickets(device: _kvio.Device, pool: _kvio.HostPool) -> None:
    fill_random(pool, 4)
    device.register_host_pools([pool])
    chunk = 256 * 1024
    t1 = device.submit_write([(i * chunk, pool.address + i * chunk, chunk) for i in range(32)])
    t2 = device.submit_write([(16 * MiB, pool.address, chunk)])
    r1 = device.wait(t1, timeout=30)
    r2 = device.wait(t2)
    assert len(r1) == 32 and all(r.ok for r in r1) and r2[0].ok
    assert [r.index for r in r1] == list(range(32))
    with pytest.raises(ValueError, match="ticket"):
        device.wait(t1)  # consumed
    t3 = device.submit_read([(i * chunk, pool.address + 32 * MiB + i * chunk, chunk, r1[i].checksum)
                             for i in range(32)])
    while not device.poll(t3):
        pass
    assert device.poll(t3)  # poll does not consume
    assert all(r.ok for r in device.wait(t3))
    assert device.wait(device.submit_read([])) == []
    stats = device.stats()
    assert stats["bytes_written"] >= 33 * chunk and stats["inflight"] == 0


def test_concurrent_python_threads(device: _kvio.Device, pool: _kvio.HostPool) -> None:
    """Several threads submit and wait at once; every chunk lands at its own offset intact."""
    buf = fill_random(pool, 5)
    device.register_host_pools([pool])
    chunk, per_thread, nthreads = 128 * 1024, 12, 6
    errors: list[BaseException] = []
    checksums: dict[int, int] = {}
    lock = threading.Lock()

    def worker(t: int) -> None:
        try:
            for i in range(per_thread):
                k = t * per_thread + i
                [w] = device.write([(k * chunk, pool.address + k * chunk, chunk)])
                with lock:
                    checksums[k] = w.checksum
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    n = nthreads * per_thread
    base = 32 * MiB
    results = device.read([(k * chunk, pool.address + base + k * chunk, chunk, checksums[k])
                           for k in range(n)])
    assert all(r.ok for r in results)
    assert np.array_equal(buf[base : base + n * chunk], buf[: n * chunk])


def test_two_devices_in_parallel(scratch: Path, pool: _kvio.HostPool) -> None:
    """Requests to different devices are in flight at the same time (each has its own ring)."""
    fill_random(pool, 6)
    devs = [_kvio.Device(str(scratch / f"d{i}.img"), capacity=16 * MiB) for i in range(2)]
    for d in devs:
        d.register_host_pools([pool])
    chunk = 1 * MiB
    tickets = [d.submit_write([(i * chunk, pool.address + i * chunk, chunk) for i in range(8)])
               for d in devs]
    results = [d.wait(t) for d, t in zip(devs, tickets, strict=True)]
    for rs in results:
        assert all(r.ok for r in rs)
    # Same data on both devices -> same checksums.
    assert [r.checksum for r in results[0]] == [r.checksum for r in results[1]]
    for d in devs:
        d.close()


def test_wait_timeout_keeps_ticket(shm_dir: Path, pool: _kvio.HostPool) -> None:
    """wait(timeout) either returns or raises TimeoutError; the ticket stays valid after a timeout."""
    with _kvio.Device(str(shm_dir / "t.img"), capacity=64 * MiB, backend="posix", threads=1) as dev:
        ticket = dev.submit_read([(i * MiB, pool.address + i * MiB, MiB) for i in range(64)])
        try:
            results = dev.wait(ticket, timeout=0)
        except TimeoutError as e:
            assert str(ticket) in str(e)
            results = dev.wait(ticket, timeout=30)
        assert len(results) == 64 and all(r.ok for r in results)
