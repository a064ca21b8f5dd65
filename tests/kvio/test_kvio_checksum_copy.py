"""checksum() is xxHash64; memcpy/copy_many move bytes exactly, with several threads too."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash
from conftest import MiB

from vllm_kvpool import _kvio


def test_checksum_matches_xxhash64() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 * MiB + 17, dtype=np.uint8)
    raw = data.tobytes()
    sizes = list(range(0, 70)) + [127, 128, 1000, 4096, 65535, MiB, 3 * MiB + 17]
    for n in sizes:
        assert _kvio.checksum(raw[:n]) == xxhash.xxh64_intdigest(raw[:n]), n
    assert _kvio.checksum(data, 100, seed=5) == xxhash.xxh64_intdigest(raw[:100], seed=5)
    assert _kvio.checksum(data.ctypes.data + 3, 999) == xxhash.xxh64_intdigest(raw[3:1002])
    with pytest.raises(ValueError, match="nbytes"):
        _kvio.checksum(data.ctypes.data)
    with pytest.raises(ValueError, match="exceeds"):
        _kvio.checksum(b"abc", 4)


def test_memcpy_and_copy_many_forms() -> None:
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 32 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    _kvio.memcpy(dst.ctypes.data, src.ctypes.data, 1000)
    assert np.array_equal(dst[:1000], src[:1000]) and dst[1000] == 0
    # Scatter 1 MiB blocks in reverse order: list form, then an (N, 3) uint64 array, 4 threads.
    blk = MiB
    ops = [(dst.ctypes.data + (31 - i) * blk, src.ctypes.data + i * blk, blk) for i in range(32)]
    dst[:] = 0
    assert _kvio.copy_many(ops) == 32 * blk
    expect = src.reshape(32, blk)[::-1].reshape(-1)
    assert np.array_equal(dst, expect)
    dst[:] = 0
    assert _kvio.copy_many(np.array(ops, dtype=np.uint64), threads=4) == 32 * blk
    assert np.array_equal(dst, expect)
    with pytest.raises(TypeError, match=r"\(N, 3\)"):
        _kvio.copy_many(np.zeros((2, 2), np.uint64))
    with pytest.raises(TypeError, match="copy op 0"):
        _kvio.copy_many([(1, 2)])


def test_copies_from_several_python_threads() -> None:
    """The GIL is released, so concurrent copies from Python threads all complete correctly."""
    src = np.random.default_rng(2).integers(0, 256, 16 * MiB, dtype=np.uint8)
    dsts = [np.zeros_like(src) for _ in range(4)]

    def run(d: np.ndarray) -> None:
        for _ in range(5):
            _kvio.copy_many([(d.ctypes.data, src.ctypes.data, src.size)], threads=2)

    threads = [threading.Thread(target=run, args=(d,)) for d in dsts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in dsts:
        assert np.array_equal(d, src)
