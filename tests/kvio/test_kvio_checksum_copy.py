"""checksum() is XXH3-64 (one-shot and streamed over pieces); memcpy/copy_many move bytes exactly,
with several threads too."""

from __future__ import annotations

import threading
from itertools import pairwise

import numpy as np
import pytest
import xxhash
from conftest import MiB

from vllm_kvpool import _kvio

SEED = 0x9E3779B97F4A7C15  # a 64-bit seed: the long path derives its secret from it
BIG = [MiB - 1, MiB + 1, 3 * MiB + 17]  # > 1 MiB: many 1024-byte blocks, uneven tails


def test_checksum_matches_xxh3_at_every_length() -> None:
    """Every length to 1100 crosses each XXH3 path (0, 1-3, 4-8, 9-16, 17-128, 129-240, long) and
    the first block edges; the big ones run the vector kernel over many blocks."""
    data = np.random.default_rng(0).integers(0, 256, 3 * MiB + 17, dtype=np.uint8)
    raw = data.tobytes()
    for n in [*range(1101), *BIG]:
        for seed in (0, SEED):
            want = xxhash.xxh3_64_intdigest(raw[:n], seed=seed)
            assert _kvio.checksum(raw[:n], seed=seed) == want, (n, seed)
    assert _kvio.checksum(data, 100, seed=5) == xxhash.xxh3_64_intdigest(raw[:100], seed=5)
    assert _kvio.checksum(data.ctypes.data + 3, 999) == xxhash.xxh3_64_intdigest(raw[3:1002])
    assert _kvio.checksum(raw[:2000]) != xxhash.xxh64_intdigest(raw[:2000])  # not the old XXH64
    with pytest.raises(ValueError, match="nbytes"):
        _kvio.checksum(data.ctypes.data)
    with pytest.raises(ValueError, match="exceeds"):
        _kvio.checksum(b"abc", 4)


def _random_split(rng: np.random.Generator, n: int) -> list[int]:
    """Offsets 0 = c0 < c1 < ... = n: pieces of 1-300 bytes (smaller and larger than the hash's
    256-byte buffer) mixed with pieces of up to 70000 bytes."""
    cuts = [0]
    while cuts[-1] < n:
        most = 300 if rng.random() < 0.5 else 70000
        cuts.append(min(n, cuts[-1] + int(rng.integers(1, most + 1))))
    return cuts


def test_streamed_checksum_of_random_pieces_matches_xxh3() -> None:
    """copy_many_checksum streams a chunk piece by piece (as scattered KV pages and NVMe requests
    arrive): any split, down to single bytes, hashes like the contiguous bytes, including a final
    stripe that reaches back into pieces already consumed."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 3 * MiB + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    raw = src.tobytes()
    for n in [*range(1101), *BIG]:
        cuts = _random_split(rng, n)
        pieces = [[dst.ctypes.data + a, src.ctypes.data + a, b - a] for a, b in pairwise(cuts)]
        ops = np.array(pieces, dtype=np.uint64).reshape(-1, 3)
        assert _kvio.copy_many_checksum(ops) == xxhash.xxh3_64_intdigest(raw[:n]), n
        assert np.array_equal(dst[:n], src[:n]), n
        dst[:n] = 0


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
