"""(1) ``vllm_kvpool._kvio`` built on the GPU machine against the carried liburing, then the
transfer engine's GPU path: CUDA KV tensors -> host pool and -> a file on the machine's disk
(through the SSD handler's staging buffers, O_DIRECT), back into zeroed KV tensors, checked
byte for byte; GB/s of each leg next to a plain ``cudaMemcpyAsync`` (``Tensor.copy_(...,
non_blocking=True)``) of the same bytes to/from pinned and pageable host memory. And the load
path a GPU user runs: a 32K-token prefix fetched from a host pool into the CUDA KV cache with
the connector worker's calls (a sync load, ``wait_layer`` layer after layer as vLLM's forward
calls ``wait_for_layer_load``, then ``wait_sync_loads``), with a contiguous and a shuffled block table, GB/s against one pinned
``cudaMemcpyAsync`` of the same bytes (``ratio``, goal >= 0.8).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpucheck import adapters
from gpucheck.common import (
    NO_GPU,
    ROOT,
    Budget,
    PartContext,
    RowWriter,
    cuda_sync,
    error_text,
)

FILE = "kvio.csv"
ERROR_ROW = {"test": "part", "path": "-"}


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    num_blocks: int
    chunk_tokens: int
    staging: str

    @property
    def page_bytes(self) -> int:  # one block of one layer, K and V, bf16
        return 2 * self.block_tokens * self.kv_heads * self.head_dim * 2

    @property
    def total_bytes(self) -> int:
        return self.layers * self.num_blocks * self.page_bytes


# GPU: Llama-3.1-8B's KV geometry (32 layers, 8 KV heads, head 128, bf16), 16384 tokens = 2 GiB,
# half to the host pool, half to the file.
GPU_SHAPE = Shape(32, 8, 128, 16, 1024, 256, "256MiB")
DRY_SHAPE = Shape(2, 2, 16, 16, 64, 64, "4MiB")
# The fetch: Llama-3.1-8B's geometry, a 32768-token prefix (2048 blocks, 128 chunks) = 4 GiB.
FETCH_SHAPE = Shape(32, 8, 128, 16, 2048, 256, "-")
DRY_FETCH_SHAPE = Shape(2, 2, 16, 16, 64, 64, "-")
FETCH_GOAL = 0.8  # fetch GB/s over pinned cudaMemcpyAsync GB/s of the same bytes


def build_kvio(prefix: str | None, build_dir: Path, out_dir: Path, configure_only: bool = False,
               env: dict | None = None) -> dict:
    """Configure (and build) the C++ core with CMake against the liburing that pkg-config finds
    first (the carried prefix's, when the harness set PKG_CONFIG_PATH to it). Returns facts."""
    import pybind11

    env = {**os.environ, **(env or {})}
    build_dir.mkdir(parents=True, exist_ok=True)
    args = ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DKVPOOL_BUILD_TESTS=OFF", "-DKVPOOL_WITH_SPDK=OFF",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    t0 = time.perf_counter()
    conf = subprocess.run(args, capture_output=True, text=True, env=env)
    print(conf.stdout[-3000:], conf.stderr[-3000:], flush=True)
    if conf.returncode:
        raise RuntimeError(f"cmake configure failed (exit {conf.returncode}): "
                           f"{conf.stderr.strip()[-400:]}")
    facts: dict = {"configure_s": round(time.perf_counter() - t0, 2)}
    m = re.search(r"kvio: liburing (\S+)", conf.stdout)
    facts["liburing_version"] = m.group(1).rstrip(",") if m else None
    cache = (build_dir / "CMakeCache.txt").read_text()
    m = re.search(r"^pkgcfg_lib_LIBURING_uring:FILEPATH=(.*)$", cache, flags=re.M)
    facts["liburing_link"] = m.group(1) if m else None
    m = re.search(r"^LIBURING_INCLUDEDIR:INTERNAL=(.*)$", cache, flags=re.M)
    facts["liburing_include"] = m.group(1) if m else None
    facts["from_prefix"] = bool(prefix) and all(
        (facts[k] or "").startswith(str(prefix)) for k in ("liburing_link", "liburing_include"))
    if configure_only:
        return facts
    t1 = time.perf_counter()
    build = subprocess.run(["cmake", "--build", str(build_dir), "--target", "_kvio", "-j",
                            str(os.cpu_count() or 2)], capture_output=True, text=True, env=env)
    print(build.stdout[-2000:], build.stderr[-2000:], flush=True)
    if build.returncode:
        raise RuntimeError(f"cmake build failed (exit {build.returncode}): "
                           f"{build.stderr.strip()[-400:]}")
    facts["build_s"] = round(time.perf_counter() - t1, 2)
    so = sorted(out_dir.glob("_kvio*.so"))
    facts["module"] = str(so[0]) if so else None
    if so and shutil.which("ldd"):
        ldd = subprocess.run(["ldd", str(so[0])], capture_output=True, text=True).stdout
        m = re.search(r"liburing\S*\s+=>\s+(\S+)", ldd)
        facts["liburing_loaded"] = m.group(1) if m else "static or not linked"
    return facts


def _make_kv(shape: Shape, device: str) -> dict:
    import torch

    kv = {}
    for i in range(shape.layers):
        t = torch.empty(shape.num_blocks, shape.kv_heads, shape.block_tokens, 2 * shape.head_dim,
                        dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-(2**14), 2**14)
        kv[f"layers.{i}"] = t
    return kv


def _equal(kv: dict, ref: dict) -> bool:
    import torch

    return all(torch.equal(kv[k].view(torch.int16), ref[k].view(torch.int16)) for k in kv)


def engine_roundtrip(shape: Shape, device: str, workdir: Path, w: RowWriter,
                     backend: str) -> dict:
    """Save half the KV to a host pool and half to a file, zero the KV, load both back: each
    half through its own ``LocalPool`` (one device each, so each leg is one medium)."""
    import torch

    kv = _make_kv(shape, device)
    ref = {k: v.clone() for k, v in kv.items()}
    cuda_sync(device)
    chunk_blocks = shape.chunk_tokens // shape.block_tokens
    slot_hint = -(-shape.layers * shape.page_bytes * chunk_blocks // 4096) * 4096
    half = shape.num_blocks // 2
    cap = (half // chunk_blocks + 2) * slot_hint
    hashes = [f"roundtrip-{i}".encode() for i in range(shape.num_blocks)]
    ids = list(range(shape.num_blocks))
    where = "gpu" if device == "cuda" else "cpu_kv"
    media = [({"host": {"capacity": cap}}, "host_pool", slice(0, half)),
             ({"ssd": {"path": str(workdir / "kvpool-file.bin"), "backend": backend,
                       "capacity": cap}}, f"file ({backend}, staging)",
              slice(half, shape.num_blocks))]  # fmt: skip
    pools = []
    legs = {}
    try:
        for medium, _, _ in media:
            pools.append(adapters.kvpool_local(kv, shape.num_blocks, shape.block_tokens,
                                               shape.chunk_tokens, medium, shape.staging))  # fmt: skip
        chunk_bytes = pools[0].layout.chunk_bytes
        for pool, (_, name, part) in zip(pools, media, strict=True):
            chunks = len(ids[part]) // chunk_blocks
            t0 = time.perf_counter()
            saved = pool.save(hashes[part], ids[part])
            cuda_sync(device)
            legs[f"{where}->{name}"] = (chunks * chunk_bytes, time.perf_counter() - t0)
            if saved != chunks:
                raise RuntimeError(f"{name}: {saved} of {chunks} chunks saved")
        for t in kv.values():
            t.zero_()
        cuda_sync(device)
        for pool, (_, name, part) in zip(pools, media, strict=True):
            t0 = time.perf_counter()
            result = pool.fetch(hashes[part], ids[part])
            cuda_sync(device)
            legs[f"{name}->{where}"] = (len(ids[part]) // chunk_blocks * chunk_bytes,
                                        time.perf_counter() - t0)  # fmt: skip
            if not result.ok or result.blocks != len(ids[part]):
                raise RuntimeError(f"{name}: {result.blocks} blocks loaded, ok={result.ok}")
        exact = _equal(kv, ref)
    finally:
        for pool in pools:
            pool.close()
        (workdir / "kvpool-file.bin").unlink(missing_ok=True)
        del kv, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, (nbytes, secs) in legs.items():
        w.write(test="engine", path=name, bytes=nbytes, seconds=secs, gbps=nbytes / secs / 1e9,
                byte_exact=exact, repeats=1, status="ok" if exact else "error",
                note="" if exact else "the KV loaded back differs from the KV saved",
                detail={"layers": shape.layers, "chunk_bytes": chunk_bytes,
                        "backend": backend, "kv_device": device})
    return {"byte_exact": exact, "backend": backend,
            "gbps": {k: round(b / s / 1e9, 3) for k, (b, s) in legs.items()}}


def _copy_seconds(dst, src, repeats: int) -> list[float]:
    """``repeats`` cudaMemcpyAsync of ``src`` into ``dst``, each timed with CUDA events."""
    import torch

    times = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def _pinned_h2d_seconds(nbytes: int, repeats: int) -> list[float]:
    """One cudaMemcpyAsync of ``nbytes`` from pinned host memory, timed with CUDA events."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = _copy_seconds(gpu, host, repeats)
    del host, gpu
    return times


def worker_fetch(shape: Shape, device: str, w: RowWriter, repeats: int = 3,
                 verify: bool = False, tables: tuple[str, ...] = ("contiguous", "shuffled"),
                 profile: bool = False) -> dict:
    """Save a prefix into a host pool, then fetch it back into zeroed KV tensors with the calls
    ``PoolWorker`` makes (built as ``register_kv_caches`` builds it; the worker module itself
    imports vLLM, which the GPU machine lacks): a sync load, ``wait_layer`` per layer,
    ``wait_sync_loads``. Into the same
    blocks (contiguous runs: one copy per run) and into a shuffled block table (short runs: one
    staged copy per chunk and one gather per layer); byte-exact checks and GB/s per table.
    ``verify``: the pool's ``verify_checksums`` (off by default: host chunks are hashed when
    saved; on, every fetch hashes them first, on the loader thread)."""
    import torch

    from vllm_kvpool.protocol import LoadRequest

    kv = _make_kv(shape, device)
    ref = {k: v.clone() for k, v in kv.items()}
    bpc = shape.chunk_tokens // shape.block_tokens
    chunks = shape.num_blocks // bpc
    slot_bytes = -(-shape.layers * shape.page_bytes * bpc // 4096) * 4096
    pool = adapters.kvpool_local(kv, shape.num_blocks, shape.block_tokens, shape.chunk_tokens,
                                 {"host": {"capacity": (chunks + 1) * slot_bytes}},
                                 verify=verify)  # fmt: skip
    eng = pool.engine
    hashes = [f"fetch-{i}".encode() for i in range(shape.num_blocks)]
    nbytes = shape.num_blocks * shape.layers * shape.page_bytes
    out: dict = {}
    try:
        t0 = time.perf_counter()
        saved = pool.save(hashes, list(range(shape.num_blocks)))
        cuda_sync(device)
        save_s = time.perf_counter() - t0
        if saved != chunks:
            raise RuntimeError(f"saves failed: {saved} of {chunks} chunks saved")
        pinned = eng.copier.pinned_bytes
        baseline = None
        if device == "cuda":
            baseline = statistics.median(_pinned_h2d_seconds(nbytes, repeats))
        gen = torch.Generator().manual_seed(0)
        orders = {"contiguous": torch.arange(shape.num_blocks),
                  "shuffled": torch.randperm(shape.num_blocks, generator=gen)}  # fmt: skip
        reads_of: dict[str, tuple] = {}
        for table in tables:
            ids = orders[table]
            # The pool's own jobs for this block table (as the scheduler builds them).
            reads = reads_of[table] = tuple(r for r, _ in pool.pool.load_jobs(
                pool.pool.lookup(hashes), [ids.tolist()]))  # fmt: skip
            times, exact = [], True
            for i in range(repeats):
                for t in kv.values():
                    t.zero_()
                cuda_sync(device)
                t0 = time.perf_counter()
                eng.start_loads([LoadRequest(f"{table}-{i}", reads, is_async=False)])
                for name in kv:  # as vLLM's forward: each layer waits for its own copies
                    eng.wait_layer(name)
                eng.wait_sync_loads()
                cuda_sync(device)
                times.append(time.perf_counter() - t0)
                eng.wait_all()
                if eng.take_invalid_blocks():
                    raise RuntimeError(f"{table}: blocks reported invalid")
                dev_ids = ids.to(device)
                exact = exact and all(torch.equal(kv[k].index_select(0, dev_ids).view(torch.int16),
                                                  ref[k].view(torch.int16)) for k in kv)  # fmt: skip
            med = statistics.median(times)
            ratio = baseline / med if baseline else None
            label = f"{table}, verified" if verify else table
            out[label] = {"gbps": round(nbytes / med / 1e9, 3), "byte_exact": exact,
                          "ratio": None if ratio is None else round(ratio, 3)}  # fmt: skip
            note = "" if exact else "the KV fetched differs from the KV saved"
            if exact and ratio is None:
                note = f"{NO_GPU}: the CPU path, no cudaMemcpyAsync reference"
            elif exact and ratio < FETCH_GOAL:
                note = f"ratio {ratio:.2f} below the goal {FETCH_GOAL}"
            w.write(test="fetch", path=f"host_pool->{'gpu' if device == 'cuda' else 'cpu_kv'} "
                    f"({label})", bytes=nbytes, seconds=med, gbps=nbytes / med / 1e9,
                    byte_exact=exact, repeats=repeats, status="ok" if exact else "error",
                    note=note, detail={"tokens": shape.num_blocks * shape.block_tokens,
                                       "layers": shape.layers, "chunks": chunks,
                                       "best_s": min(times), "save_s": round(save_s, 3),
                                       "memcpy_pinned_h2d_s": baseline, "ratio": ratio,
                                       "goal": FETCH_GOAL, "pinned_bytes": pinned,
                                       "verify_checksums": verify,
                                       "copier": type(eng.copier).__name__})  # fmt: skip
        if profile and device == "cuda":
            try:  # a diagnosis: the measurements above stand without it
                prof = _profile_fetch(eng, reads_of["contiguous"], kv)
                w.write(test="fetch_profile", path="host_pool->gpu (contiguous)",
                        bytes=nbytes, seconds=prof["wall_s"], gbps=nbytes / prof["wall_s"] / 1e9,
                        repeats=1, status="ok", detail=prof)
            except Exception as exc:  # noqa: BLE001
                w.write(test="fetch_profile", path="host_pool->gpu (contiguous)", seconds=0,
                        status="error", note=error_text(exc))
    finally:
        pool.close()
        del kv, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def _profile_fetch(eng, reads, kv: dict, log_lines: int = 30) -> dict:
    """One more contiguous fetch under torch.profiler (every thread's aten calls and the CUDA
    copies): where its wall time goes, printed to the log."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vllm_kvpool.protocol import LoadRequest

    for t in kv.values():
        t.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.start_loads([LoadRequest("profiled", reads, is_async=False)])
        for name in kv:
            eng.wait_layer(name)
        eng.wait_sync_loads()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    eng.wait_all()
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cpu_time_total", row_limit=log_lines), flush=True)
    copies = [e for e in avg if e.key == "aten::copy_"]
    memcpy_us = sum(e.device_time_total for e in avg if "Memcpy HtoD" in e.key)
    return {"wall_s": wall, "copy_calls": copies[0].count if copies else 0,
            "copy_cpu_s": copies[0].cpu_time_total / 1e6 if copies else 0.0,
            "memcpy_htod_device_s": memcpy_us / 1e6}


def copy_diagnosis(w: RowWriter, copies: int = 4096, size: int = 1 << 20) -> dict:
    """``copies`` host-to-device ``copy_(non_blocking=True)`` of ``size`` bytes each (the fetch's
    pattern: 128 chunks x 32 layers of 1 MiB) from torch-pinned, ``cudaHostRegister``-ed and
    pageable host memory, against one copy of the same bytes: the per-call cost and whether
    registered memory moves at pinned speed (``is_pinned`` as torch sees it)."""
    import mmap

    import torch

    nbytes = copies * size
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf = mmap.mmap(-1, nbytes)
    registered = torch.frombuffer(buf, dtype=torch.uint8)
    registered.fill_(1)
    cudart = torch.cuda.cudart()
    reg_err = int(cudart.cudaHostRegister(registered.data_ptr(), nbytes, 0))
    sources = {"pinned (torch)": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
               "registered (cudaHostRegister)": registered,
               "pageable": torch.empty(nbytes, dtype=torch.uint8)}
    out: dict = {"register_error": reg_err}
    try:
        for name, src in sources.items():
            src.fill_(2)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(copies):
                dev[i * size:(i + 1) * size].copy_(src[i * size:(i + 1) * size], non_blocking=True)
            issued = time.perf_counter() - t0
            torch.cuda.synchronize()
            many = time.perf_counter() - t0
            t0 = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            one = time.perf_counter() - t0
            out[name] = {"many_gbps": round(nbytes / many / 1e9, 2),
                         "one_gbps": round(nbytes / one / 1e9, 2),
                         "issue_us_per_copy": round(issued / copies * 1e6, 1),
                         "is_pinned": bool(src.is_pinned())}
            w.write(test="copy_diag", path=f"{name}->gpu", bytes=nbytes, seconds=many,
                    gbps=nbytes / many / 1e9, byte_exact=bool(torch.equal(dev[:size].cpu(),
                                                                          src[:size])),
                    repeats=1, status="ok", detail={**out[name], "copies": copies,
                                                    "copy_bytes": size, "one_copy_s": one,
                                                    "register_error": reg_err})
    finally:
        if reg_err == 0:
            cudart.cudaHostUnregister(registered.data_ptr())
        del sources, registered, dev
        buf.close()
        torch.cuda.empty_cache()
    return out


def memcpy_baseline(nbytes: int, w: RowWriter, repeats: int = 5) -> dict:
    """cudaMemcpyAsync of ``nbytes`` between the GPU and pinned / pageable host memory."""
    import torch

    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for name, dst, src in (("d2h", host, gpu), ("h2d", gpu, host)):
            times = _copy_seconds(dst, src, repeats)
            path = f"{name}_{'pinned' if pinned else 'pageable'}"
            best, med = min(times), statistics.median(times)
            out[path] = round(nbytes / med / 1e9, 3)
            w.write(test="memcpy", path=path, bytes=nbytes, seconds=med, gbps=nbytes / med / 1e9,
                    byte_exact=True, repeats=repeats, status="ok",
                    note="cudaMemcpyAsync via Tensor.copy_(non_blocking=True), median",
                    detail={"best_gbps": round(nbytes / best / 1e9, 3)})
        del host
    return out


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    summary: dict = {}
    workdir = Path(ctx.workdir)
    if ctx.dry_run:
        w.write(test="build", path="cmake", seconds=0, status="skipped",
                note="dry run: the installed vllm_kvpool._kvio is used; the build against the "
                     "carried liburing runs on the GPU machine (its CMake configure is tested "
                     "by tests/gpu_check/test_gpu_carry.py)")
    else:
        t0 = time.perf_counter()
        try:
            facts = build_kvio(ctx.kvio_prefix, workdir / "build", ROOT / "vllm_kvpool")
            from vllm_kvpool.native import kvio

            facts["backends"] = list(kvio().backends())
            w.write(test="build", path="cmake", seconds=time.perf_counter() - t0, status="ok",
                    note="" if facts["from_prefix"] else "liburing NOT from the carried prefix",
                    detail=facts)
            summary["build"] = facts
        except Exception as exc:  # noqa: BLE001 - without _kvio the engine legs cannot run
            w.write(test="build", path="cmake", seconds=time.perf_counter() - t0,
                    status="error", note=error_text(exc))
            return {"_status": "error", "build_error": error_text(exc)}
    budget.check("the worker-path fetch")
    try:
        fetch_shape = DRY_FETCH_SHAPE if ctx.dry_run else FETCH_SHAPE
        # the default (host chunks unverified on fetch), then verify_checksums on
        summary["fetch"] = worker_fetch(fetch_shape, ctx.device, w, profile=True)
        summary["fetch"].update(worker_fetch(fetch_shape, ctx.device, w, verify=True,
                                             tables=("contiguous",)))
    except Exception as exc:  # noqa: BLE001 - recorded; the round trip still runs
        w.write(test="fetch", path="host_pool->kv (worker)", seconds=0, status="error",
                note=error_text(exc))
        summary["fetch_error"] = error_text(exc)
    fetch = summary.get("fetch")
    if not fetch or not all(f["byte_exact"] for f in fetch.values()):
        summary["_status"] = "error"
    budget.check("the engine round trip")
    shape = DRY_SHAPE if ctx.dry_run else GPU_SHAPE
    for backend in ("uring", "posix"):  # posix only if the sandbox refuses io_uring
        try:
            summary["engine"] = engine_roundtrip(shape, ctx.device, workdir, w, backend)
            break
        except Exception as exc:  # noqa: BLE001 - recorded; the next backend is tried
            w.write(test="engine", path=f"round trip ({backend})", seconds=0, status="error",
                    note=error_text(exc))
            summary[f"engine_{backend}_error"] = error_text(exc)
    if not summary.get("engine", {}).get("byte_exact"):
        summary["_status"] = "error"
    if ctx.device != "cuda":
        w.write(test="memcpy", path="cudaMemcpyAsync", seconds=0, status="skipped", note=NO_GPU)
        return summary
    budget.check("the cudaMemcpyAsync baseline")
    summary["memcpy"] = memcpy_baseline(shape.total_bytes // 2, w)
    budget.check("the copy diagnosis")
    try:
        summary["copy_diag"] = copy_diagnosis(w)
    except Exception as exc:  # noqa: BLE001 - a diagnosis; the measurements above stand
        w.write(test="copy_diag", path="-", seconds=0, status="error", note=error_text(exc))
    return summary
