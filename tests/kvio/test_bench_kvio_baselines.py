"""benchmarks/bench_kvio.py's kernel-path baselines read the same bytes the engine reads: the
threaded buffered and O_DIRECT pread at the engine's queue depth check every chunk against the
checksum the engine wrote, and a damaged chunk is named, never counted."""

from __future__ import annotations

import pytest

from tests.bench_module import load_benchmark

MiB = 1 << 20


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("bench_kvio")
    return module


@pytest.mark.parametrize("direct", [False, True])
def test_threaded_pread_reads_the_engines_bytes(bench, scratch, direct):
    path = scratch / "baseline.img"
    size, chunk = 16 * MiB, 2 * MiB
    checksums = bench.create_file(path, size, chunk)
    run = bench.bench_pread_threads(path, size, chunk, 4, direct, checksums)
    assert run.nbytes == size and run.seconds > 0
    assert run.method == f"{'O_DIRECT' if direct else 'buffered'} pread x4"
    # one byte of chunk 5 changed behind the engine's back: that chunk is named
    with open(path, "r+b") as f:
        f.seek(5 * chunk + 7)
        byte = f.read(1)[0]
        f.seek(5 * chunk + 7)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(RuntimeError, match=r"chunks \[5\]"):
        bench.bench_pread_threads(path, size, chunk, 4, direct, checksums)
