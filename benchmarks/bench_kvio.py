"""KV-passthrough read benchmark: cold 2 MiB chunks through the page cache vs. io_uring O_DIRECT.

Reads --size-gib GiB of --chunk-mib MiB chunks from a cold device file, in the same run:
  (a) buffered pread() through the filesystem (page cache dropped first) on a pool of
      --queue-depth threads: as many reads in flight as the engine keeps, each chunk verified
      (XXH3-64, as the engine verifies): the kernel's own path at the same queue depth;
  (b) the same with O_DIRECT (page-aligned buffers): the kernel path without the page cache;
  (c) the `uring` backend of vllm_kvpool._kvio (O_DIRECT, registered buffers, checksum-verified,
      --queue-depth reads in flight);
  (d) a single-threaded synchronous read() loop, unverified: the old baseline, kept as a third
      row (it mixes queue depth with the page cache).
Each is run --repeats times (alternating) and the median is reported: GB/s and kernel (system)
CPU seconds per GB from getrusage. The last line is

    ratio_throughput=X ratio_sys_cpu=Y ratio_vs_buffered_qd=R ratio_sys_cpu_qd=C

with X = uring GB/s / single-thread read() GB/s and Y = its sys-s/GB / uring's (the old pair),
R = uring GB/s / buffered pread at the same queue depth and C = that baseline's sys-s/GB /
uring's (the like-for-like pair).

With --backend spdk (needs the module built with SPDK and a target: --trid or KVPOOL_SPDK_TRID)
it instead reads the namespace through the `spdk` backend (checksum-verified, --queue-depth ops
of --chunk-mib in flight) and, interleaved with it (ABBA order), runs SPDK's own
`spdk_nvme_perf` (--perf or on PATH) at the same queue depth and I/O size. Both are pinned to
the same CPUs (--perf-core-mask: perf's -c, the backend's poller and this process's threads), so
neither gets a core the other lacks; loopback NVMe/TCP swings widely on a VM, so the default is
--repeats 9 and the spread of the per-pair ratios is printed. Beside each verified pass runs the
same pass without checksums (attribution only: the pool verifies every SSD read). The last line is

    spdk_gbps=X perf_gbps=Y unverified_ratio=U ratio_vs_spdk_perf=P

with P the median over the pairs of X/Y (each pair run back to back) and U the same for the
unverified pass. Measure with the target's
polling core excluded: ``quiet-run --exclude-pid <nvmf_tgt pid> -- ...``.

    .venv/bin/python benchmarks/bench_kvio.py --size-gib 2
    .venv/bin/python benchmarks/bench_kvio.py --backend spdk --trid "$KVPOOL_SPDK_TRID" --size-gib 1.5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
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


def _aligned(nbytes: int) -> memoryview:
    """A page-aligned buffer (O_DIRECT needs block alignment): an anonymous mapping."""
    import mmap

    return memoryview(mmap.mmap(-1, nbytes))


def bench_pread_threads(path: Path, size: int, chunk: int, threads: int, direct: bool,
                        checksums: list[int] | None) -> Run:
    """Every chunk read with ``os.preadv`` by ``threads`` threads (``threads`` reads in flight,
    the GIL released in the call), each chunk checked against its checksum when given."""
    from concurrent.futures import ThreadPoolExecutor

    drop_cache(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    n = size // chunk
    bufs = [_aligned(chunk) for _ in range(threads)]
    bad: list[int] = []

    def worker(k: int) -> int:
        got = 0
        for i in range(k, n, threads):
            m = os.preadv(fd, [bufs[k]], i * chunk)
            if m != chunk or (checksums is not None and _kvio.checksum(bufs[k]) != checksums[i]):
                bad.append(i)
            got += m
        return got

    s0, u0 = rusage()
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(worker, range(threads)))
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    s1, u1 = rusage()
    if bad:
        raise RuntimeError(f"pread ({'O_DIRECT' if direct else 'buffered'}): chunks {bad[:5]} "
                           "short or not the bytes written")
    method = f"{'O_DIRECT' if direct else 'buffered'} pread x{threads}"
    return Run(method, seconds, total, s1 - s0, u1 - u0)


def bench_device(method: str, dev: _kvio.Device, pool: _kvio.HostPool, size: int, chunk: int,
                 checksums: list[int] | None, ops_in_flight: int = 0) -> Run:
    """Streams every chunk of the device with ~ops_in_flight (default: queue_depth) reads in
    flight (two tickets); each read verified against its checksum (None: not verified)."""
    per_ticket = max(1, (ops_in_flight or dev.queue_depth) // 2)
    n = size // chunk
    s0, u0 = rusage()
    t0 = time.perf_counter()
    pending: list[int] = []
    half = 0
    total = 0
    for first in range(0, n, per_ticket):
        ops = [(i * chunk, pool.address + (half * per_ticket + (i - first)) * chunk, chunk,
                *([] if checksums is None else [checksums[i]]))
               for i in range(first, min(n, first + per_ticket))]  # fmt: skip
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


def run_nvme_perf(perf: str, trid: str, qd: int, chunk: int, seconds: float, mask: str) -> Run:
    """SPDK's spdk_nvme_perf reading the same namespace at the same queue depth and I/O size."""
    cmd = [perf, "-r", trid, "-q", str(qd), "-o", str(chunk), "-w", "read", "-t",
           str(max(1, round(seconds))), "-c", mask]
    s0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + seconds)
    s1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = re.search(r"^Total\s*:\s*([\d.]+)\s+([\d.]+)", out.stdout, re.M)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {out.returncode}):\n"
                           f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    mib_s = float(m.group(2))
    secs = max(1, round(seconds))
    return Run("spdk_nvme_perf", secs, int(mib_s * MiB * secs), s1.ru_stime - s0.ru_stime,
               s1.ru_utime - s0.ru_utime)


def cpus_of_mask(mask: str) -> set[int]:
    """CPUs of an SPDK core mask ("0x5") or list ("0,2", "[1-3]")."""
    mask = mask.strip().strip("[]")
    if mask.lower().startswith("0x"):
        bits = int(mask, 16)
        return {i for i in range(bits.bit_length()) if bits >> i & 1}
    cpus: set[int] = set()
    for part in mask.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main_spdk(args: argparse.Namespace, chunk: int, size: int) -> int:
    trid = args.trid or os.environ.get("KVPOOL_SPDK_TRID", "")
    why = ("module built without SPDK" if "spdk" not in _kvio.backends()
           else "no target (--trid / KVPOOL_SPDK_TRID)" if not trid else "")
    perf = args.perf or shutil.which("spdk_nvme_perf") or ""
    if not why and not perf:
        why = "spdk_nvme_perf not found (--perf or PATH)"
    if why:
        print(f"spdk: skipped ({why})")
        return 0
    # The same CPUs as spdk_nvme_perf -c: the backend's poller (below) and this process.
    os.sched_setaffinity(0, cpus_of_mask(args.perf_core_mask))
    # The Device's queue depth counts NVMe commands: --queue-depth ops of one chunk each, split
    # to the controller's max transfer size, as spdk_nvme_perf splits its I/Os.
    with _kvio.Device(trid, backend="spdk", name="bench-probe") as d:
        per_op = -(-chunk // d.max_transfer)
        size = min(size, d.capacity // chunk * chunk)
    qd_cmds = min(4096, args.queue_depth * per_op)
    print(f"spdk read benchmark: {size / (1 << 30):.2f} GiB in {args.chunk_mib} MiB ops, "
          f"{args.queue_depth} ops in flight ({qd_cmds} NVMe commands of <= "
          f"{chunk // per_op // 1024} KiB), target {trid}", flush=True)
    pool = _kvio.HostPool(args.queue_depth * chunk, name="bench-dst")
    src = _kvio.HostPool(chunk, name="bench-spdk-src")
    np.frombuffer(src, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, chunk,
                                                                       dtype=np.uint8)
    results: dict[str, list[Run]] = {}
    with _kvio.Device(trid, backend="spdk", capacity=size, queue_depth=qd_cmds,
                      spdk_core_mask=args.spdk_core_mask if args.spdk_core_mask is not None
                      else args.perf_core_mask, name="bench-spdk") as dev:
        dev.register_host_pools([pool, src])
        sums: list[int] = []
        for first in range(0, size // chunk, 32):
            sums += [r.checksum for r in dev.write(
                [(i * chunk, src.address, chunk) for i in range(first, min(size // chunk, first + 32))])]
        last = 1.0
        ratios: list[float] = []
        unverified: list[float] = []
        for rep in range(args.repeats):  # ABBA: neither method always runs first
            order = ("spdk", "perf") if rep % 2 == 0 else ("perf", "spdk")
            pair: dict[str, Run] = {}
            for method in order:
                if method == "spdk":
                    pair[method] = bench_device("spdk", dev, pool, size, chunk, sums,
                                                args.queue_depth)  # fmt: skip
                    last = pair[method].seconds
                    # Attribution, not the product path (the pool verifies every SSD read):
                    # the same pass without checksums, on the same core.
                    pair["unverified"] = bench_device("spdk unverified", dev, pool, size, chunk,
                                                      None, args.queue_depth)  # fmt: skip
                else:
                    pair[method] = run_nvme_perf(perf, trid, args.queue_depth, chunk, last,
                                                 args.perf_core_mask)  # fmt: skip
            results.setdefault("spdk", []).append(pair["spdk"])
            results.setdefault("spdk_nvme_perf", []).append(pair["perf"])
            results.setdefault("spdk unverified", []).append(pair["unverified"])
            ratios.append(pair["spdk"].gbps / pair["perf"].gbps)
            unverified.append(pair["unverified"].gbps / pair["perf"].gbps)
            print(f"  [{rep + 1}/{args.repeats}] spdk {pair['spdk'].gbps:6.2f} GB/s   "
                  f"spdk_nvme_perf {pair['perf'].gbps:6.2f} GB/s   ratio {ratios[-1]:.2f}   "
                  f"(unverified {pair['unverified'].gbps:.2f} GB/s, {unverified[-1]:.2f})",
                  flush=True)  # fmt: skip
    med = {m: statistics.median(r.gbps for r in rs) for m, rs in results.items()}
    spread = {m: (min(r.gbps for r in rs), max(r.gbps for r in rs)) for m, rs in results.items()}
    for m in med:
        print(f"{m:<16} median {med[m]:6.2f} GB/s  (min {spread[m][0]:.2f}, max {spread[m][1]:.2f})")
    ratio = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio, ratio, ratio]
    print(f"ratio per pair: median {ratio:.2f}, quartiles {q[0]:.2f}-{q[2]:.2f}, "
          f"min {min(ratios):.2f}, max {max(ratios):.2f} (n={len(ratios)})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kvio_spdk.json").write_text(json.dumps(
        {"size_bytes": size, "chunk_bytes": chunk, "queue_depth_ops": args.queue_depth,
         "queue_depth_commands": qd_cmds, "trid": trid, "core_mask": args.perf_core_mask,
         "runs": {m: [asdict(r) | {"gbps": r.gbps} for r in rs] for m, rs in results.items()},
         "ratios": ratios, "unverified_ratios": unverified, "ratio_vs_spdk_perf": ratio},
        indent=2))
    print(f"spdk_gbps={med['spdk']:.2f} perf_gbps={med['spdk_nvme_perf']:.2f} "
          f"unverified_ratio={statistics.median(unverified):.2f} ratio_vs_spdk_perf={ratio:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("uring", "spdk"), default="uring",
                    help="uring: vs buffered read(); spdk: vs spdk_nvme_perf")
    ap.add_argument("--size-gib", type=float, default=2.0, help="GiB to read per method (> 0, default 2; any size works: "
                         "with spdk, at most the target namespace, e.g. 1.5 on "
                         "KVPOOL_TGT_MALLOC_MIB=1536 as in docs/kvio-spdk.md)")
    ap.add_argument("--chunk-mib", type=int, default=2, help="chunk size in MiB")
    ap.add_argument("--queue-depth", type=int, default=32, help="ops (chunks) in flight")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per method, median reported (default 3; spdk 9)")
    ap.add_argument("--dir", type=Path, default=REPO / ".tmp", help="where the device file lives")
    ap.add_argument("--out", type=Path, default=REPO / "out", help="JSON results go here")
    ap.add_argument("--trid", default="", help="spdk: transport id (default KVPOOL_SPDK_TRID)")
    ap.add_argument("--perf", default="", help="spdk: path of spdk_nvme_perf")
    ap.add_argument("--perf-core-mask", default="0x1", help="spdk: spdk_nvme_perf -c")
    ap.add_argument("--spdk-core-mask", default=None,
                    help="spdk: poller CPUs of the backend (default: --perf-core-mask, the same "
                         "core spdk_nvme_perf polls on)")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 9 if args.backend == "spdk" else 3
    if args.size_gib <= 0 or args.chunk_mib <= 0 or args.repeats <= 0:
        ap.error("--size-gib, --chunk-mib and --repeats must be positive")
    chunk = args.chunk_mib * MiB
    size = int(args.size_gib * (1 << 30)) // chunk * chunk
    if args.backend == "spdk":
        return main_spdk(args, chunk, size)
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
            qd = args.queue_depth
            methods = {
                "buffered read()": lambda: bench_buffered(path, size, chunk),
                "buffered pread qd": lambda: bench_pread_threads(path, size, chunk, qd, False,
                                                                 checksums),
                "O_DIRECT pread qd": lambda: bench_pread_threads(path, size, chunk, qd, True,
                                                                 checksums),
                "uring O_DIRECT": lambda: (drop_cache(path), bench_device(
                    "uring O_DIRECT", dev, pool, size, chunk, checksums))[1],
            }
            for rep in range(args.repeats):
                order = list(methods) if rep % 2 == 0 else list(methods)[::-1]
                for method in order:
                    run = methods[method]()
                    results.setdefault(method, []).append(run)
                    print(f"  [{rep + 1}/{args.repeats}] {run.method:<20} {run.gbps:6.2f} GB/s  "
                          f"sys {run.sys_s_per_gb:.4f} s/GB", flush=True)
    finally:
        path.unlink(missing_ok=True)

    med = {m: median_run(rs) for m, rs in results.items()}
    print(f"\n{'method':<22}{'GB/s':>8}{'sys s/GB':>11}{'user s/GB':>11}")
    for r in med.values():
        print(f"{r.method:<22}{r.gbps:8.2f}{r.sys_s_per_gb:11.4f}"
              f"{r.user_s / (r.nbytes / GB):11.4f}")
    base, ours = med["buffered read()"], med["uring O_DIRECT"]
    ratio_tp = ours.gbps / base.gbps
    ratio_sys = base.sys_s_per_gb / max(ours.sys_s_per_gb, 1e-6)
    qd_base = med["buffered pread qd"]
    ratio_qd = ours.gbps / qd_base.gbps
    ratio_sys_qd = qd_base.sys_s_per_gb / max(ours.sys_s_per_gb, 1e-6)
    print(f"at the same queue depth ({args.queue_depth}): uring / buffered pread {ratio_qd:.2f}x "
          f"GB/s, O_DIRECT pread / buffered pread "
          f"{med['O_DIRECT pread qd'].gbps / qd_base.gbps:.2f}x; single-thread read() row kept "
          f"as the old baseline (uring / it: {ratio_tp:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kvio.json").write_text(json.dumps(
        {"size_bytes": size, "chunk_bytes": chunk, "queue_depth": args.queue_depth,
         "runs": {m: [asdict(r) | {"gbps": r.gbps, "sys_s_per_gb": r.sys_s_per_gb} for r in rs]
                  for m, rs in results.items()},
         "ratio_throughput": ratio_tp, "ratio_sys_cpu": ratio_sys,
         "ratio_vs_buffered_qd": ratio_qd, "ratio_sys_cpu_qd": ratio_sys_qd}, indent=2))
    print(f"ratio_throughput={ratio_tp:.2f} ratio_sys_cpu={ratio_sys:.1f} "
          f"ratio_vs_buffered_qd={ratio_qd:.2f} ratio_sys_cpu_qd={ratio_sys_qd:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
