"""KV-passthrough read benchmark: cold 2 MiB chunks through the page cache vs. io_uring O_DIRECT.

Reads --size-gib GiB of --chunk-mib MiB chunks from a cold device file, in the same run:
  (a) buffered read() through the filesystem after posix_fadvise(DONTNEED),
  (b) the `uring` backend of vllm_kvpool._kvio (O_DIRECT, registered buffers, checksum-verified),
  (c) the `spdk` backend when compiled in and KVPOOL_SPDK_TRID names a target.
Each is run --repeats times (alternating) and the median is reported: GB/s and kernel (system)
CPU seconds per GB from getrusage. The last line is

    ratio_throughput=X ratio_sys_cpu=Y

with X = uring GB/s / buffered GB/s and Y = buffered sys-s/GB / uring sys-s/GB.

    .venv/bin/python benchmarks/bench_kvio.py --size-gib 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_kvpool import _kvio

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
GB = 1e9


@dataclass
class Run:
    method: str
    seconds: float
    nbytes: int
    sys_s: float
    user_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB

    @property
    def sys_s_per_gb(self) -> float:
        return self.sys_s / (self.nbytes / GB)


def rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)  # includes our I/O threads and io-wq workers
    return r.ru_stime, r.ru_utime


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def create_file(path: Path, size: int, chunk: int) -> list[int]:
    """Writes random chunks with O_DIRECT (so nothing lands in the page cache); returns checksums."""
    pool = _kvio.HostPool(64 * MiB, name="bench-src")
    np.frombuffer(pool, np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, pool.capacity, dtype=np.uint8
    )
    per_pool = pool.capacity // chunk
    checksums: list[int] = []
    with _kvio.Device(str(path), capacity=size, backend="uring") as dev:
        dev.register_host_pools([pool])
        n = size // chunk
        batch = 32
        with tqdm(total=size, unit="B", unit_scale=True, desc="create file", file=sys.stderr) as bar:
            for first in range(0, n, batch):
                ops = [(i * chunk, pool.address + (i % per_pool) * chunk, chunk)
                       for i in range(first, min(n, first + batch))]
                checksums += [r.checksum for r in dev.write(ops)]
                bar.update(len(ops) * chunk)
    return checksums


def bench_buffered(path: Path, size: int, chunk: int) -> Run:
    drop_cache(path)
    buf = bytearray(chunk)
    view = memoryview(buf)
    s0, u0 = rusage()
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while total < size:
            n = f.readinto(view)
            if not n:
                break
            total += n
    seconds = time.perf_counter() - t0
    s1, u1 = rusage()
    return Run("buffered read()", seconds, total, s1 - s0, u1 - u0)


def bench_device(method: str, dev: _kvio.Device, pool: _kvio.HostPool, size: int, chunk: int,
                 checksums: list[int]) -> Run:
    """Streams every chunk of the device with ~queue_depth reads in flight (two tickets)."""
    per_ticket = max(1, dev.queue_depth // 2)
    n = size // chunk
    s0, u0 = rusage()
    t0 = time.perf_counter()
    pending: list[int] = []
    half = 0
    total = 0
    for first in range(0, n, per_ticket):
        ops = [(i * chunk, pool.address + (half * per_ticket + (i - first)) * chunk, chunk,
                checksums[i]) for i in range(first, min(n, first + per_ticket))]
        pending.append(dev.submit_read(ops))
        half ^= 1
        if len(pending) == 2:
            total += sum(r.length for r in dev.wait(pending.pop(0)))
    for t in pending:
        total += sum(r.length for r in dev.wait(t))
    seconds = time.perf_counter() - t0
    s1, u1 = rusage()
    return Run(method, seconds, total, s1 - s0, u1 - u0)


def median_run(runs: list[Run]) -> Run:
    runs = sorted(runs, key=lambda r: r.seconds)
    mid = runs[len(runs) // 2]
    return Run(mid.method, mid.seconds, mid.nbytes,
               statistics.median(r.sys_s for r in runs), statistics.median(r.user_s for r in runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0, help="bytes to read per method (>= 2)")
    ap.add_argument("--chunk-mib", type=int, default=2, help="chunk size in MiB")
    ap.add_argument("--queue-depth", type=int, default=32, help="uring/spdk queue depth")
    ap.add_argument("--repeats", type=int, default=3, help="runs per method (median reported)")
    ap.add_argument("--dir", type=Path, default=REPO / ".tmp", help="where the device file lives")
    ap.add_argument("--out", type=Path, default=REPO / "out", help="JSON results go here")
    args = ap.parse_args(argv)
    if args.size_gib <= 0 or args.chunk_mib <= 0 or args.repeats <= 0:
        ap.error("--size-gib, --chunk-mib and --repeats must be positive")
    chunk = args.chunk_mib * MiB
    size = int(args.size_gib * (1 << 30)) // chunk * chunk
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"bench_kvio_{os.getpid()}.img"
    print(f"kvio read benchmark: {size / (1 << 30):.2f} GiB in {args.chunk_mib} MiB chunks, "
          f"file {path}, backends {_kvio.backends()}", flush=True)
    results: dict[str, list[Run]] = {}
    try:
        checksums = create_file(path, size, chunk)
        pool = _kvio.HostPool(args.queue_depth * chunk, name="bench-dst")
        with _kvio.Device(str(path), backend="uring", queue_depth=args.queue_depth) as dev:
            dev.register_host_pools([pool])
            for rep in range(args.repeats):
                for method in ("buffered read()", "uring O_DIRECT"):
                    if method == "buffered read()":
                        run = bench_buffered(path, size, chunk)
                    else:
                        drop_cache(path)
                        run = bench_device(method, dev, pool, size, chunk, checksums)
                    results.setdefault(method, []).append(run)
                    print(f"  [{rep + 1}/{args.repeats}] {method:<16} {run.gbps:6.2f} GB/s  "
                          f"sys {run.sys_s_per_gb:.4f} s/GB", flush=True)
        trid = os.environ.get("KVPOOL_SPDK_TRID", "")
        if "spdk" in _kvio.backends() and trid:
            with _kvio.Device(trid, backend="spdk", capacity=size,
                              queue_depth=args.queue_depth) as sdev:
                sdev.register_host_pools([pool])
                src = _kvio.HostPool(chunk, name="bench-spdk-src")
                sums = [r.checksum for r in sdev.write(
                    [(i * chunk, src.address, chunk) for i in range(size // chunk)])]
                for _ in range(args.repeats):
                    results.setdefault("spdk", []).append(
                        bench_device("spdk", sdev, pool, size, chunk, sums))
        else:
            why = "not compiled" if "spdk" not in _kvio.backends() else "KVPOOL_SPDK_TRID unset"
            print(f"  spdk: skipped ({why})", flush=True)
    finally:
        path.unlink(missing_ok=True)

    med = {m: median_run(rs) for m, rs in results.items()}
    print(f"\n{'method':<18}{'GB/s':>8}{'sys s/GB':>11}{'user s/GB':>11}")
    for m, r in med.items():
        print(f"{m:<18}{r.gbps:8.2f}{r.sys_s_per_gb:11.4f}{r.user_s / (r.nbytes / GB):11.4f}")
    base, ours = med["buffered read()"], med["uring O_DIRECT"]
    ratio_tp = ours.gbps / base.gbps
    ratio_sys = base.sys_s_per_gb / max(ours.sys_s_per_gb, 1e-6)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kvio.json").write_text(json.dumps(
        {"size_bytes": size, "chunk_bytes": chunk, "queue_depth": args.queue_depth,
         "runs": {m: [asdict(r) | {"gbps": r.gbps, "sys_s_per_gb": r.sys_s_per_gb} for r in rs]
                  for m, rs in results.items()},
         "ratio_throughput": ratio_tp, "ratio_sys_cpu": ratio_sys}, indent=2))
    print(f"ratio_throughput={ratio_tp:.2f} ratio_sys_cpu={ratio_sys:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
