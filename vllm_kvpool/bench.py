"""Fetch a long-context prefix's KV into KV-cache tensors: serial tiers vs the unified pool.

(a) LMCache-style serial tiers: the prefix's first chunks in a host pool, the rest as one file
    per chunk on the SSD, read with buffered I/O after dropping the page cache, one device at
    a time. (b) vLLM's OffloadingConnector (reported when it cannot run here). (c) The pool:
    the real ``UnifiedPool`` placement + ``TransferEngine`` over the same host pool size plus
    the SSD as an O_DIRECT device, every device read at once.
Shapes default to Llama-3.1-8B (32 layers, 8 KV heads, head 128, bf16; 32K tokens = 4 GiB).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_kvpool.config import parse_pool_config
from vllm_kvpool.engine import TransferEngine
from vllm_kvpool.handlers import open_handlers
from vllm_kvpool.kv_layout import KVLayout
from vllm_kvpool.native import kvio
from vllm_kvpool.placement import DeviceWeights, fetch_seconds
from vllm_kvpool.pool import PoolGeometry, UnifiedPool, layout_fingerprint
from vllm_kvpool.protocol import ChunkRead, ChunkSave, LoadRequest

GPU_MODEL = ("H100-SXM bf16 989 TFLOP/s dense at 40% MFU; Llama-3.1-8B prefill FLOPs = "
             "2*8.0e9*S + 4*L*d*S*(P+S/2); fetch time as measured here")  # fmt: skip


@dataclass
class Shape:
    tokens: int = 32768
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    chunk_tokens: int = 256

    @property
    def num_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def page_bytes(self) -> int:  # one block of one layer, K and V, bf16
        return 2 * self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def prefix_bytes(self) -> int:
        return self.num_blocks * self.layers * self.page_bytes


@dataclass
class Result:
    name: str
    seconds: float
    nbytes: int
    sys_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def _sys_time() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def make_kv(shape: Shape, page_aligned: bool = True) -> dict[str, torch.Tensor]:
    """Per-layer KV views [blocks, heads, block_size, 2*head_dim] (vLLM's LBHNC layout).

    ``page_aligned`` puts them at page-aligned addresses, as torch does for a CPU KV cache under
    ``THP_MEM_ALLOC_ENABLE=1``, so SSD reads can land in the KV pages directly; otherwise at
    torch's default 64-byte alignment (the staging path)."""
    layer_bytes = shape.num_blocks * shape.page_bytes
    raw = torch.empty(shape.layers * layer_bytes + (2 << 20), dtype=torch.uint8)
    base = (-raw.data_ptr()) % 4096 + (0 if page_aligned else 64)
    views = {}
    for i in range(shape.layers):
        flat = raw[base + i * layer_bytes : base + (i + 1) * layer_bytes].view(torch.bfloat16)
        views[f"layers.{i}"] = flat.view(shape.num_blocks, shape.kv_heads, shape.block_size,
                                         2 * shape.head_dim)  # fmt: skip
    return views


def kv_digest(kv: dict[str, torch.Tensor]) -> list[int]:
    io = kvio()
    return [io.checksum(t.data_ptr(), t.numel() * t.element_size()) for t in kv.values()]


def probe_host_scatter(layout: KVLayout, host_pool: torch.Tensor, chunk_bytes: int,
                       blocks: int) -> float:  # fmt: skip
    """GB/s of copying chunks from host memory into paged KV (the host tier's raw 'read'):
    distinct chunks over up to 1 GiB, so caches cannot flatter it; best of 3 passes."""
    chunks = max(1, min(host_pool.numel() // chunk_bytes, (1 << 30) // chunk_bytes))
    ops = np.concatenate([layout.chunk_ops(range(c * blocks, (c + 1) * blocks),
                                           host_pool[c * chunk_bytes :].data_ptr(), True)
                          for c in range(chunks)])  # fmt: skip
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        kvio().copy_many(ops, threads=2)
        best = min(best, time.perf_counter() - start)
    return chunks * chunk_bytes / best / 1e9


def run_serial_baseline(shape: Shape, layout: KVLayout, engine: TransferEngine, host_slots: int,
                        files_dir: Path, hashes: list[bytes], log) -> Result:  # fmt: skip
    """LMCache-style: host chunks first, then one buffered file per chunk, strictly serially."""
    bpc = shape.chunk_tokens // shape.block_size
    host_tier = engine.tiers[0]
    chunks = list(range(0, shape.num_blocks, bpc))
    files_dir.mkdir(parents=True, exist_ok=True)
    log(f"(a) writing {len(chunks) - host_slots} chunk files (one per chunk) for the baseline")
    for ci, first in enumerate(chunks):
        ids = list(range(first, min(first + bpc, shape.num_blocks)))
        buf = host_tier.view(ci, len(ids) * layout.block_bytes) \
            if ci < host_slots else torch.empty(len(ids) * layout.block_bytes, dtype=torch.uint8)  # fmt: skip
        for li in range(len(layout.layers)):
            layout.gather(li, ids, buf, len(ids))
        if ci >= host_slots:
            path = files_dir / f"chunk-{ci:06d}-{hashes[first].hex()[-12:]}.kv"
            with open(path, "wb") as f:
                f.write(buf.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # cold
    for t in layout.layers:
        t.tensor.zero_()
    sys0, start = _sys_time(), time.perf_counter()
    for ci, first in enumerate(chunks):
        ids = list(range(first, min(first + bpc, shape.num_blocks)))
        nbytes = len(ids) * layout.block_bytes
        if ci < host_slots:
            buf = host_tier.view(ci, nbytes)
        else:
            with open(files_dir / f"chunk-{ci:06d}-{hashes[first].hex()[-12:]}.kv", "rb") as f:
                buf = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        for li in range(len(layout.layers)):
            layout.scatter(li, ids, buf, len(ids))
    return Result("(a) serial tiers (LMCache-style)", time.perf_counter() - start,
                  shape.prefix_bytes, _sys_time() - sys0)  # fmt: skip


def offloading_connector_status() -> str:
    if torch.cuda.is_available():
        return "not run: needs a vLLM CUDA engine; run it with `vllm bench` on the GPU host"
    return ("not runnable here: its CPU tier's transfer handler copies GPU<->CPU on CUDA streams "
            "(vllm/v1/kv_offload/cpu/gpu_worker.py asserts gpu_tensor.is_cuda) and this machine "
            "has no GPU")  # fmt: skip


def modelled_ttft(fetch_s: float, shape: Shape, suffix: int) -> float:
    d, layers = 4096, 32
    flops = 2 * 8.0e9 * suffix + 4 * layers * d * suffix * (shape.tokens + suffix / 2)
    return fetch_s + flops / (989e12 * 0.4)


def run(shape: Shape, workdir: Path, host_fraction: float, ssd_backend: str,
        out_dir: Path | None = None, log=print, page_aligned: bool = True) -> dict:  # fmt: skip
    io = kvio()
    workdir.mkdir(parents=True, exist_ok=True)
    bpc = shape.chunk_tokens // shape.block_size
    num_chunks = -(-shape.num_blocks // bpc)
    geometry = PoolGeometry(shape.page_bytes * shape.layers, bpc,
                            layout_fingerprint(["bench", shape.page_bytes]))  # fmt: skip
    host_slots = max(1, int(num_chunks * host_fraction))
    ssd_path = workdir / "ssd0.kvpool"
    config = parse_pool_config({
        "chunk_tokens": shape.chunk_tokens, "staging": "256MiB",
        "devices": [{"host": {"capacity": host_slots * geometry.slot_bytes}},
                    {"ssd": {"path": str(ssd_path), "backend": ssd_backend,
                             "capacity": (num_chunks + 1) * geometry.slot_bytes}}]})  # fmt: skip
    log(f"KV of a {shape.tokens}-token prefix: {shape.layers} layers x {shape.kv_heads} KV heads x "
        f"head {shape.head_dim}, bf16 = {shape.prefix_bytes / 2**30:.2f} GiB in {num_chunks} chunks"
        f" of {shape.chunk_tokens} tokens; host pool {host_slots} chunks "
        f"({host_slots * geometry.slot_bytes / 2**30:.2f} GiB), SSD file {ssd_path} ({ssd_backend})")
    kv = make_kv(shape, page_aligned)
    layout = KVLayout.from_kv_caches(kv, list(kv), shape.num_blocks)
    tiers = open_handlers(config, geometry)
    engine = TransferEngine(tiers, layout, verify_checksums=True)
    hashes = [f"prefix-block-{i}".encode() for i in range(shape.num_blocks)]
    try:
        log("probing device bandwidths")
        host_gbps = probe_host_scatter(layout, tiers[0].view(0, tiers[0].pool.capacity),
                                       geometry.slot_bytes, bpc)
        ssd_gbps = max(float(io.probe_device(tiers[1].device, seconds=1.0,
                                                 chunk_bytes=4 << 20)["read_gbps"])
                       for _ in range(2))  # fmt: skip
        limit = host_gbps + ssd_gbps
        for t in kv.values():  # random KV, one layer at a time
            t.view(torch.int16).random_(-(2**14), 2**14)
        digest = kv_digest(kv)
        log(f"  host pool -> KV {host_gbps:.2f} GB/s, SSD O_DIRECT read {ssd_gbps:.2f} GB/s, "
            f"sum {limit:.2f} GB/s")
        serial = run_serial_baseline(shape, layout, engine, host_slots, workdir / "lmcache",
                                     hashes, log)  # fmt: skip
        serial_ok = kv_digest(kv) == digest

        pool = UnifiedPool(config, geometry, DeviceWeights([host_gbps, ssd_gbps]))
        chunks = [(f, hashes[f: f + bpc]) for f in range(0, shape.num_blocks, bpc)]
        planned = pool.plan_saves("prefix", chunks)
        saves = [ChunkSave("prefix", p.entry.key, p.entry.location.device, p.entry.location.slot,
                           tuple(range(p.first_block, p.first_block + p.entry.location.num_blocks)))
                 for p in planned]  # fmt: skip
        log(f"(c) storing {len(saves)} chunks: {sum(s.device == 0 for s in saves)} on host, "
            f"{sum(s.device == 1 for s in saves)} on SSD (bandwidth placement)")
        engine.finish_step_saves(saves)
        engine.wait_all()
        for key, rank, checksum in engine.take_report().committed:
            pool.acknowledge_save(key, rank, checksum)
        for t in kv.values():
            t.zero_()
        hits = pool.match(hashes)
        reads = tuple(ChunkRead(h.entry.key, h.entry.location.device, h.entry.location.slot,
                                h.entry.location.num_blocks, dict(h.entry.checksums), 0,
                                tuple(range(h.first_block, h.first_block + h.num_blocks)))
                      for h in hits)  # fmt: skip
        sys0, start = _sys_time(), time.perf_counter()
        engine.start_loads([LoadRequest("fetch", reads, is_async=True)])
        while "fetch" not in engine.take_finished([])[1]:
            time.sleep(0.0005)
        pooled = Result("(c) unified pool, bandwidth placement", time.perf_counter() - start,
                        shape.prefix_bytes, _sys_time() - sys0)  # fmt: skip
        pool_ok = kv_digest(kv) == digest and not engine.take_invalid_blocks()
        pool.transfers.merge(engine.take_report().counters)
        if out_dir is not None:
            from vllm_kvpool.metrics import plot_usage

            path = plot_usage(pool.status(), out_dir / "kvpool_usage.png",
                              title=f"kvpool: {shape.tokens}-token prefix over host + SSD")  # fmt: skip
            log(f"per-device usage plot: {path}")
    finally:
        engine.close()
        shutil.rmtree(workdir / "lmcache", ignore_errors=True)
        ssd_path.unlink(missing_ok=True)
    if not (serial_ok and pool_ok):
        raise RuntimeError(f"fetched KV differs from the saved KV (serial ok={serial_ok}, "
                           f"pool ok={pool_ok})")
    log(f"(b) vLLM OffloadingConnector: {offloading_connector_status()}")
    log(f"{'method':40s} {'seconds':>8s} {'GB/s':>7s} {'frac_of_limit':>13s} {'sys_cpu_s':>9s}")
    for r in (serial, pooled):
        log(f"{r.name:40s} {r.seconds:8.3f} {r.gbps:7.2f} {r.gbps / limit:13.2f} "
            f"{r.sys_seconds:9.3f}")
    host_bytes = sum(s.device == 0 for s in saves) * geometry.chunk_bytes
    best = fetch_seconds([host_bytes, shape.prefix_bytes - host_bytes], [host_gbps, ssd_gbps])
    log(f"a perfect pool with these capacities (host {host_bytes / 2**30:.2f} GiB) needs "
        f"{best:.3f} s; the pool reached {best / pooled.seconds:.0%} of that")
    suffix = 512
    log(f"modelled GPU TTFT ({suffix}-token uncached suffix; {GPU_MODEL}): serial "
        f"{modelled_ttft(serial.seconds, shape, suffix):.2f} s, pool "
        f"{modelled_ttft(pooled.seconds, shape, suffix):.2f} s (measured fetch "
        f"{serial.seconds:.2f} s / {pooled.seconds:.2f} s)")
    ratio = serial.seconds / pooled.seconds
    line = f"ratio_vs_serial={ratio:.2f} frac_of_limit={pooled.gbps / limit:.2f}"
    log(line)
    return {"serial": serial, "pool": pooled, "limit_gbps": limit, "line": line}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool bench", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="prefix length (default 32768)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply --tokens (e.g. 0.125)")
    p.add_argument("--host-fraction", type=float, default=0.875,
                   help="host pool size as a fraction of the prefix (must be < 1; the default "
                        "leaves room for the host's bandwidth share, so a perfect pool can reach "
                        "the summed bandwidths)")
    p.add_argument("--backend", choices=("uring", "posix"), default="uring")
    p.add_argument("--kv-align", choices=("page", "torch"), default="page",
                   help="KV-cache tensors page aligned (THP_MEM_ALLOC_ENABLE=1: SSD reads land in "
                        "the KV pages) or at torch's default 64 B (reads go through staging)")
    p.add_argument("--workdir", type=Path, default=Path("out/bench_kvpool"),
                   help="directory on the SSD for the device file and the chunk files")
    p.add_argument("--out", type=Path, default=None, help="write the usage plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokens = int(args.tokens * args.scale)
    if tokens < 256 or not 0 < args.host_fraction < 1:
        build_parser().error("--tokens*--scale must be >= 256 and 0 < --host-fraction < 1")
    shape = Shape(tokens=tokens - tokens % 256)
    run(shape, args.workdir, args.host_fraction, args.backend, args.out,
        page_aligned=args.kv_align == "page")
    return 0
