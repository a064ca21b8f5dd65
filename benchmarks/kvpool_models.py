"""The pool fetching a long prefix of the paper's models (``bench_kvpool.py --model NAME``).

Each model's KV geometry comes from ``vllm_kvpool.geometry.MODELS`` (checked against its
config.json): per-group KV tensors at the real page sizes (bf16, 16-token blocks), the prefix
saved once into a pool of one host-memory pool and one SSD file (O_DIRECT, io_uring), then the
same fetch the connector issues on a hit (every full-attention block, the sliding window only at
the hit position) timed ``--repeats`` times, each beside its in-run bound: the same fetch of each
device's share alone (exactly its chunks), bound = the slowest share alone, ``frac_of_bound`` =
bound / fetch (<= 1; above 1 the bound is wrong). GPT-OSS-20B also runs with the hybrid manager off
(every layer full attention), interleaved with the HMA run. Prints per run the bytes put back
into the KV, the bytes read from the devices and the seconds (median, min, max); the LAST line
per model is ``model=M bytes_ratio=B ratio_vs_hma_off=R frac_of_bound=F`` for a hybrid model
(HMA-off bytes and seconds over HMA-on ones), ``model=M bytes_per_token=N seconds=S
frac_of_bound=F`` for the others (F: median over repetitions, HMA on).

    python benchmarks/bench_kvpool.py --model gpt-oss-20b [--tokens 32768] [--dir /mnt/nvme]
    python benchmarks/kvpool_models.py --model llama-3.1-8b --model qwen3-30b-a3b   # the same
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_kvpool.chunk_kv import ChunkKV, section_read, section_save_ids
from vllm_kvpool.config import load_pool_config
from vllm_kvpool.engine import TransferEngine
from vllm_kvpool.geometry import MODELS, ChunkLayout
from vllm_kvpool.handlers import open_handlers
from vllm_kvpool.placement import DeviceWeights
from vllm_kvpool.pool import PoolGeometry, UnifiedPool, layout_fingerprint
from vllm_kvpool.probe import probe_bandwidths, probe_copy_threads
from vllm_kvpool.protocol import ChunkSave, LoadRequest

BLOCK, CHUNK = 16, 256  # tokens: vLLM's CUDA default block; the pool's default chunk


@dataclass
class Run:
    seconds: float
    kv_bytes: int  # put back into vLLM's KV
    device_bytes: int  # read from the pool's devices


class ModelPool:
    """One model's KV tensors and a pool holding its prefix (the connector's code paths)."""

    def __init__(self, layout: ChunkLayout, tokens: int, directory: Path, name: str) -> None:
        self.layout = layout
        self.blocks = tokens // BLOCK
        kv = {}
        for g in layout.groups:  # one [blocks, page] tensor per layer, as vLLM's views are
            for layer in g.layer_names:
                kv[layer] = torch.zeros(self.blocks, g.page_bytes // 2, dtype=torch.bfloat16)
                kv[layer].view(torch.int16).random_(generator=torch.Generator().manual_seed(len(kv)))
        self.kv = kv
        chunks = -(-self.blocks // layout.blocks_per_chunk)
        need = chunks * layout.chunk_bytes
        config = load_pool_config({
            "chunk_tokens": CHUNK, "staging": "256MiB",
            "devices": [{"host": {"capacity": need // 2 + (64 << 20)}},
                        {"ssd": {"path": str(directory / f"{name}.kvpool"),
                                 "capacity": need + (64 << 20), "backend": "uring"}}]})  # fmt: skip
        self.geometry = PoolGeometry(sum(g.block_bytes for g in layout.groups),
                                     layout.blocks_per_chunk,
                                     layout_fingerprint([name, layout.chunk_bytes]), layout)  # fmt: skip
        self.gbps = probe_bandwidths(config, self.geometry)
        self.pool = UnifiedPool(config, self.geometry, DeviceWeights(self.gbps))
        self.engine = TransferEngine(open_handlers(config, self.geometry),
                                     ChunkKV.from_kv_caches(kv, layout, self.blocks),
                                     copy_threads=probe_copy_threads(config))  # as the worker  # fmt: skip
        self.hashes = [i.to_bytes(8, "little") + name.encode() for i in range(self.blocks)]
        self.ids = [list(range(self.blocks)) for _ in range(max(g.group_id for g in layout.groups) + 1)]

    def save(self) -> None:
        bpc = self.layout.blocks_per_chunk
        chunks = [(f, self.hashes[f : f + bpc]) for f in range(0, self.blocks, bpc)]
        saves = [ChunkSave("prefix", p.entry.key, p.entry.location.device, p.entry.location.slot,
                           section_save_ids(self.layout, p.first_block, p.entry.location.num_blocks,
                                            self.ids), p.entry.location.num_blocks)
                 for p in self.pool.plan_saves("prefix", chunks)]  # fmt: skip
        self.engine.finish_step_saves(saves)
        self.engine.wait_all()
        self.pool.apply_report(self.engine.take_report())
        assert all(e.committed for e in self.pool.index.entries.values()), "prefix not stored"

    def fetch(self, device: int | None = None) -> Run:
        """The connector's fetch of the whole hit; with ``device``, only that device's share."""
        hits = self.pool.match(self.hashes)
        end = self.layout.usable_hit_blocks(
            [(h.first_block, h.entry.location.num_blocks, h.num_blocks) for h in hits])
        reads = [r for h in hits if (r := section_read(self.layout, h.entry, h.first_block,
                                                        self.ids, 0, end)) is not None]  # fmt: skip
        if device is not None:
            reads = [r for r in reads if r.device == device]
        self.engine.take_report()  # counters are per report: start from zero
        start = time.perf_counter()
        self.engine.start_loads([LoadRequest("fetch", tuple(reads), is_async=True)])
        while "fetch" not in self.engine.take_finished([])[1]:
            time.sleep(0.0002)
        seconds = time.perf_counter() - start
        assert not self.engine.take_invalid_blocks(), "a chunk failed its checksum"
        read = sum(c.bytes_read for c in self.engine.take_report().counters.devices.values())
        kv = self.layout.fetch_bytes(end) if device is None else read
        return Run(seconds, kv, read)

    @property
    def devices(self) -> list[int]:
        return sorted({e.location.device for e in self.pool.index.entries.values()})

    def close(self) -> None:
        self.engine.close()


def _line(model: str, hma: str, runs: list[Run]) -> str:
    secs = [r.seconds for r in runs]
    med = statistics.median(secs)
    return (f"model={model} hma={hma} kv_bytes={runs[0].kv_bytes} device_bytes={runs[0].device_bytes}"
            f" seconds={med:.3f} (min {min(secs):.3f} max {max(secs):.3f}, n={len(secs)})"
            f" kv_GBps={runs[0].kv_bytes / med / 1e9:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS), required=True)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the SSD file goes")
    parser.add_argument("--results", type=Path, default=Path("out/kvpool_models.jsonl"),
                        help="each repetition is appended here as it comes")  # fmt: skip
    args = parser.parse_args(argv)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.model:
            geo = MODELS[name]
            variants = ["on", "off"] if geo.sliding_layers else ["on"]
            pools = {v: ModelPool(geo.chunk_layout(BLOCK, CHUNK, hma=v == "on"), args.tokens,
                                  Path(tmp), f"{name}-{v}") for v in variants}  # fmt: skip
            runs: dict[str, list[Run]] = {v: [] for v in variants}
            fracs: dict[str, list[float]] = {v: [] for v in variants}
            try:
                for p in pools.values():
                    p.save()
                    p.fetch()  # warm-up
                for rep in range(args.repeats):  # interleaved: contention hits all alike
                    for v, p in pools.items():
                        parts = [None, *p.devices]
                        timed = {d: p.fetch(d) for d in (parts if rep % 2 == 0 else parts[::-1])}
                        runs[v].append(timed[None])
                        bound = max(timed[d].seconds for d in p.devices)
                        fracs[v].append(bound / timed[None].seconds)
                        if args.results is not None:  # a killed run keeps what it measured
                            with open(args.results, "a") as f:
                                f.write(json.dumps({"model": name, "hma": v, "rep": rep,
                                                    "seconds": timed[None].seconds,
                                                    "kv_bytes": timed[None].kv_bytes,
                                                    "alone_s": {d: timed[d].seconds
                                                                for d in p.devices}}) + "\n")  # fmt: skip
                for v in variants:
                    print(_line(name, v, runs[v]) + " frac_of_bound=" + ",".join(
                        f"{f:.2f}" for f in fracs[v]), flush=True)  # fmt: skip
                frac = statistics.median(fracs["on"])
                med = {v: statistics.median(r.seconds for r in runs[v]) for v in variants}
                if "off" in variants:
                    print(f"model={name} bytes_ratio={runs['off'][0].kv_bytes / runs['on'][0].kv_bytes:.2f}"
                          f" ratio_vs_hma_off={med['off'] / med['on']:.2f} frac_of_bound={frac:.2f}",
                          flush=True)  # fmt: skip
                else:  # every layer full attention: HMA changes nothing to compare against
                    print(f"model={name} bytes_per_token={runs['on'][0].kv_bytes // args.tokens}"
                          f" seconds={med['on']:.3f} frac_of_bound={frac:.2f}", flush=True)
            finally:
                for p in pools.values():
                    p.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
