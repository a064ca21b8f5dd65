"""A chunk whose bytes changed on disk is reported corrupt, never returned as data."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import LoopDevice, MiB

from vllm_kvpool import _kvio


def flip_byte(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_flip_detected(dev: _kvio.Device, path: str, pool: _kvio.HostPool) -> None:
    buf = np.frombuffer(pool, np.uint8)
    buf[: 4 * MiB] = np.random.default_rng(9).integers(0, 256, 4 * MiB, dtype=np.uint8)
    chunks = [(i * MiB, pool.address + i * MiB, MiB) for i in range(4)]
    written = dev.write(chunks)
    flip_byte(path, 2 * MiB + 12345)  # inside chunk 2
    reads = [(off, addr + 8 * MiB, n, w.checksum)
             for (off, addr, n), w in zip(chunks, written, strict=True)]
    results = dev.read(reads, check=False)
    assert [r.status for r in results] == ["ok", "ok", "corrupt", "ok"]
    bad = results[2]
    assert bad.errno != 0 and "checksum mismatch" in bad.message and str(2 * MiB) in bad.message
    assert bad.checksum != written[2].checksum
    with pytest.raises(_kvio.CorruptError) as e:
        dev.read(reads)
    assert e.value.offset == 2 * MiB and e.value.device == dev.name
    assert [r.status for r in e.value.results] == ["ok", "ok", "corrupt", "ok"]
    assert dev.stats()["corrupt"] == 2
    # Unverified reads (no expected checksum) are plain data with checksum 0.
    [plain] = dev.read([(0, pool.address + 8 * MiB, MiB)])
    assert plain.ok and plain.checksum == 0


@pytest.mark.parametrize("backend", ["uring", "posix"])
def test_flipped_byte_on_file(scratch: Path, pool: _kvio.HostPool, backend: str) -> None:
    path = str(scratch / "dev.img")
    with _kvio.Device(path, capacity=8 * MiB, backend=backend) as dev:
        check_flip_detected(dev, path, pool)


def test_flipped_byte_on_loop_device(loop_device: LoopDevice, pool: _kvio.HostPool) -> None:
    with _kvio.Device(loop_device.path) as dev:
        check_flip_detected(dev, loop_device.path, pool)
