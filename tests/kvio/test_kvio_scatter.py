"""Scatter/gather chunk I/O: one device range <-> many host buffers, one checksum per chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import MiB

from vllm_kvpool import _kvio


@pytest.fixture(params=["uring", "posix"])
def device(request: pytest.FixtureRequest, scratch: Path, shm_dir: Path):
    where = scratch if request.param == "uring" else shm_dir
    with _kvio.Device(str(where / "dev.img"), capacity=16 * MiB, backend=request.param) as dev:
        yield dev


def _segments(pool: _kvio.HostPool, order: list[int], base: int, piece: int) -> np.ndarray:
    return np.array([[pool.address + base + i * piece, piece] for i in order], dtype=np.uint64)


def test_gather_write_and_scatter_read_round_trip(device: _kvio.Device, pool: _kvio.HostPool):
    src = np.frombuffer(pool, np.uint8)
    rng = np.random.default_rng(7)
    piece, n = 256 * 1024, 8
    src[: n * piece] = rng.integers(0, 256, n * piece, dtype=np.uint8)
    order = [5, 2, 7, 0, 1, 6, 3, 4]  # pages in a KV tensor are rarely in chunk order
    gathered = b"".join(src[i * piece : (i + 1) * piece].tobytes() for i in order)
    [w] = device.write([(0, _segments(pool, order, 0, piece), n * piece)])
    assert w.ok and w.checksum == xxhash.xxh3_64_intdigest(gathered)

    dst_base = 4 * MiB
    [r] = device.read([(0, _segments(pool, list(reversed(range(n))), dst_base, piece), n * piece,
                        w.checksum)])  # fmt: skip
    assert r.ok and r.checksum == w.checksum
    landed = b"".join(src[dst_base + i * piece : dst_base + (i + 1) * piece].tobytes()
                      for i in reversed(range(n)))  # fmt: skip
    assert landed == gathered


def test_scatter_read_of_a_flipped_byte_is_corrupt(device: _kvio.Device, pool: _kvio.HostPool):
    src = np.frombuffer(pool, np.uint8)
    src[: 2 * MiB] = 3
    [w] = device.write([(0, pool.address, 2 * MiB)])
    src[MiB + 17] = 4  # same bytes on the device, except one
    device.write([(0, pool.address, 2 * MiB)])
    [r] = device.read([(0, _segments(pool, [1, 0], 4 * MiB, MiB), 2 * MiB, w.checksum)],
                      check=False)  # fmt: skip
    assert r.status == "corrupt" and "checksum mismatch" in r.message


def test_segment_errors_name_the_segment(scratch: Path, pool: _kvio.HostPool):
    with _kvio.Device(str(scratch / "a.img"), capacity=4 * MiB) as dev:
        bad = np.array([[pool.address, 4096], [pool.address + 4096 + 64, 4096]], dtype=np.uint64)
        with pytest.raises(_kvio.AlignmentError, match="segment 1: host address"):
            dev.submit_read([(0, bad, 8192)])
        short = np.array([[pool.address, 4096]], dtype=np.uint64)
        with pytest.raises(_kvio.AlignmentError, match="segments hold 4096 bytes, the op says 8192"):
            dev.submit_write([(0, short, 8192)])
        with pytest.raises(ValueError, match="segments is empty"):
            dev.submit_read([(0, [], 4096)])
        assert dev.stats()["inflight"] == 0


def test_copy_many_checksum_copies_and_hashes_in_op_order(pool: _kvio.HostPool):
    buf = np.frombuffer(pool, np.uint8)
    buf[: 3 * MiB] = np.random.default_rng(1).integers(0, 256, 3 * MiB, dtype=np.uint8)
    ops = np.array([[pool.address + 8 * MiB + (2 - i) * MiB, pool.address + i * MiB, MiB]
                    for i in range(3)], dtype=np.uint64)  # fmt: skip
    digest = _kvio.copy_many_checksum(ops)
    assert digest == xxhash.xxh3_64_intdigest(buf[: 3 * MiB].tobytes())
    for i in range(3):
        dst = buf[8 * MiB + (2 - i) * MiB :][:MiB]
        assert (dst == buf[i * MiB : (i + 1) * MiB]).all()
