"""`make demo` step: store and fetch a long-context prefix over a host pool + a file-backed SSD.

An 8K-token Llama-3.1-8B-shaped prefix (32 layers x 8 KV heads x head 128, bf16: 1 GiB of KV)
in vLLM's CPU layout, a host pool holding 3/8 of it and an O_DIRECT file device for the rest,
bandwidth placement from a short probe. Saves the prefix, wipes the KV, fetches it back from
both devices at once, checks it byte for byte and writes the per-device usage plot to --out.
Uses only the package's public API (``vllm_kvpool.local.LocalPool``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from rich.console import Console

from vllm_kvpool.local import LocalPool
from vllm_kvpool.metrics import plot_usage
from vllm_kvpool.native import kvio

LAYERS, KV_HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 16, 256


def make_kv(num_blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer [blocks, heads, block_size, 2*head] bf16 views at page-aligned addresses (as
    torch allocates a CPU KV cache under THP_MEM_ALLOC_ENABLE=1), filled with random bits."""
    page = 2 * BLOCK * KV_HEADS * HEAD * 2
    layer_bytes = num_blocks * page
    raw = torch.empty(LAYERS * layer_bytes + 4096, dtype=torch.uint8)
    base = (-raw.data_ptr()) % 4096
    kv = {}
    for i in range(LAYERS):
        flat = raw[base + i * layer_bytes : base + (i + 1) * layer_bytes]
        kv[f"layers.{i}"] = flat.view(torch.bfloat16).view(num_blocks, KV_HEADS, BLOCK, 2 * HEAD)
        kv[f"layers.{i}"].view(torch.int16).random_(-(2**14), 2**14)
    return kv


def digest(kv: dict[str, torch.Tensor]) -> list[int]:
    return [kvio().checksum(t.data_ptr(), t.numel() * t.element_size()) for t in kv.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    log = Console().print
    tokens = max(CHUNK, args.tokens - args.tokens % CHUNK)
    blocks = tokens // BLOCK
    kv = make_kv(blocks)
    chunk_bytes = CHUNK // BLOCK * LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2
    chunks = tokens // CHUNK
    work = args.out / "kvpool_demo"
    work.mkdir(parents=True, exist_ok=True)
    config = {"chunk_tokens": CHUNK, "probe": {"seconds": 0.3, "size": "64MiB"},
              "devices": [{"host": {"capacity": max(1, chunks * 3 // 8) * chunk_bytes}},
                          {"ssd": {"path": str(work / "ssd0.kvpool"), "backend": "uring",
                                   "capacity": (chunks + 1) * chunk_bytes}}]}  # fmt: skip
    hashes = [f"demo-prefix-{i}".encode() for i in range(blocks)]
    ids = list(range(blocks))
    want = digest(kv)
    log(f"{tokens}-token Llama-3.1-8B-shaped prefix: {chunks * chunk_bytes / 2**30:.2f} GiB of KV "
        f"in {chunks} chunks; host pool 3/8 of it, the rest on {work / 'ssd0.kvpool'} (O_DIRECT)")
    try:
        with LocalPool(config, kv, blocks, BLOCK) as pool:
            weights = dict(zip((d.name for d in pool.config.devices), pool.pool.weights.gbps,
                               strict=True))  # fmt: skip
            log("probed read bandwidth (placement weights, GB/s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in weights.items()))
            saved = pool.save(hashes, ids)
            for t in kv.values():
                t.zero_()
            result = pool.fetch(hashes, ids)
            status = pool.status()
            for name, c in status.transfers.devices.items():
                log(f"  {name}: {c.chunks_written} chunks stored, {c.bytes_read / 2**30:.2f} GiB "
                    f"fetched at {c.read_gbps:.2f} GB/s")
            same = digest(kv) == want
            log(f"stored {saved} chunks; fetched {result.blocks * BLOCK} tokens in "
                f"{result.seconds:.3f} s ({chunks * chunk_bytes / result.seconds / 1e9:.2f} GB/s), "
                f"KV byte-identical: {same}")
            log(f"per-device usage plot: {plot_usage(status, args.out / 'kvpool_usage.png')}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same and result.ok and saved == chunks else 1


if __name__ == "__main__":
    sys.exit(main())
