"""The pool fetching a long prefix of the paper's models (``bench_kvpool.py --model NAME``).

Each model's KV geometry comes from ``MODELS`` below (checked against its
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
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_kvpool.config import load_pool_config
from vllm_kvpool.layout import ChunkLayout, ModelGeometry
from vllm_kvpool.layout import build as layouts
from vllm_kvpool.local import LocalPool

BLOCK, CHUNK = 16, 256  # tokens: vLLM's CUDA default block; the pool's default chunk

# Each checked against the model's config.json (num_hidden_layers, num_key_value_heads, head_dim
# or hidden_size / num_attention_heads, torch_dtype, sliding_window, layer_types).
MODELS: dict[str, ModelGeometry] = {
    "llama-3.1-8b": ModelGeometry(
        "meta-llama/Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
        sliding_window=None, sliding_layers=0,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "gpt-oss-20b": ModelGeometry(
        "openai/gpt-oss-20b", num_layers=24, num_kv_heads=8, head_dim=64, dtype_bytes=2,
        sliding_window=128, sliding_layers=12,  # layer_types: sliding, full, sliding, ...
        source="https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json"),
    "qwen3-30b-a3b": ModelGeometry(
        "Qwen/Qwen3-30B-A3B", num_layers=48, num_kv_heads=4, head_dim=128, dtype_bytes=2,
        sliding_window=None, sliding_layers=0,  # use_sliding_window: false
        source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
}  # fmt: skip


@dataclass
class Run:
    seconds: float
    kv_bytes: int  # put back into vLLM's KV
    device_bytes: int  # read from the pool's devices


class ModelPool:
    """One model's KV tensors and a ``LocalPool`` holding its prefix (the connector's jobs)."""

    def __init__(self, model: ModelGeometry, hma: bool, tokens: int, directory: Path,
                 name: str) -> None:  # fmt: skip
        self.blocks = tokens // BLOCK
        chunk_bytes = ChunkLayout(tuple(model.groups(BLOCK, hma)), CHUNK // BLOCK).chunk_bytes
        need = -(-self.blocks * BLOCK // CHUNK) * chunk_bytes
        config = load_pool_config({
            "chunk_tokens": CHUNK, "staging": "256MiB",
            "devices": [{"host": {"capacity": need // 2 + (64 << 20)}},
                        {"ssd": {"path": str(directory / f"{name}.kvpool"),
                                 "capacity": need + (64 << 20), "backend": "uring"}}]})  # fmt: skip
        self.layout = layouts.from_model(config, model, BLOCK, hma)
        kv = {}
        for g in self.layout.groups:  # one [blocks, page] tensor per layer, as vLLM's views are
            for layer in g.layer_names:
                kv[layer] = torch.zeros(self.blocks, g.page_bytes // 2, dtype=torch.bfloat16)
                kv[layer].view(torch.int16).random_(generator=torch.Generator().manual_seed(len(kv)))
        self.local = LocalPool(config, kv, self.blocks, BLOCK, layout=self.layout)
        self.hashes = [i.to_bytes(8, "little") + name.encode() for i in range(self.blocks)]
        self.ids = list(range(self.blocks))

    def save(self) -> None:
        chunks = -(-self.blocks // self.layout.blocks_per_chunk)
        assert self.local.save(self.hashes, self.ids) == chunks, "prefix not stored"

    def _bytes_read(self) -> int:
        return sum(c.bytes_read for c in self.local.status().transfers.devices.values())

    def fetch(self, device: int | None = None) -> Run:
        """The connector's fetch of the whole hit; with ``device``, only that device's share."""
        before = self._bytes_read()
        result = self.local.fetch(self.hashes, self.ids,
                                  devices=None if device is None else {device})  # fmt: skip
        assert result.ok, "a chunk failed its checksum"
        read = self._bytes_read() - before
        kv = self.layout.fetch_bytes(result.blocks) if device is None else read
        return Run(result.seconds, kv, read)

    @property
    def devices(self) -> list[int]:
        """The devices holding part of the prefix."""
        return [d for d, u in enumerate(self.local.status().usage) if u.used_slots]

    def close(self) -> None:
        self.local.close()


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
            pools = {v: ModelPool(geo, v == "on", args.tokens, Path(tmp), f"{name}-{v}")
                     for v in variants}  # fmt: skip
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
                    # the copy threads the worker's probe picked: two runs of one machine can
                    # pick differently and take different host-copy paths
                    print(_line(name, v, runs[v]) + " frac_of_bound=" + ",".join(
                        f"{f:.2f}" for f in fracs[v])
                        + f" copy_threads={pools[v].local.engine.loads.copy_threads}",
                        flush=True)  # fmt: skip
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
