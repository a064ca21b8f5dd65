"""(6) ttft: the paper's long-prefix time to first token, on the GPU, with the pool's fetch path.

A Llama-3.1-8B-shaped model with random weights (transformers' ``LlamaForCausalLM``, SDPA
attention, bf16; vLLM is not on the GPU image). Per prefix length (32K and 128K tokens):

* the prefix P's KV is computed once (a previous request's), written into vLLM's paged layout
  (per layer ``[blocks, 2, block, kv_heads, head_dim]``) and saved to the pool: half the chunks
  in a host pool, half in a file on the machine's disk (the SSD handler, O_DIRECT);
* ``recompute``: the whole prompt P + S from nothing, S a suffix of new tokens (drawn fresh, its
  chunks in no pool), up to the logits of the first generated token;
* ``pool``: the paged KV zeroed, the pool fetches P into it through ``LocalPool.fetch`` (the
  transfer engine's load path the connector's worker runs), the pages are gathered into the
  model's cache, and only S is prefilled over it, up to the same logits.

TTFT is the wall time to that first token (CUDA synchronised); ``speedup`` = recompute / pool.
Checks: the pool served exactly P (its lookup of P + S hits P's blocks, none of S's), the KV it
fetched is byte-identical to the KV saved, and the first token equals the recompute's (with
random weights two logits can nearly tie in bf16: the top-2 gap is recorded beside it).
Rows go to ``kvio.csv`` (``test`` = ``ttft``): the kit returns at most 8 files.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck.common import ROOT, Budget, PartContext, RowWriter, cuda_sync, error_text

FILE = "kvio.csv"
ERROR_ROW = {"test": "ttft", "path": "-"}
TTFT_GOAL_S = 10.0  # the paper's long-context claim: under 10 s at 128K
SPEEDUP_GOAL = 4.1


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class Plan:
    model: Model
    prefixes: tuple[int, ...]  # tokens
    suffix: int  # new tokens prefilled over the fetched prefix
    block: int
    chunk: int
    dtype: str
    repeats: int


LLAMA_8B = Model(32, 4096, 14336, 32, 8, 128, 128256)
GPU_PLAN = Plan(LLAMA_8B, (32768, 131072), 2048, 16, 256, "bfloat16", 1)
DRY_PLAN = Plan(Model(2, 64, 128, 4, 2, 16, 512), (256, 512), 64, 16, 64, "float32", 2)


def build_model(m: Model, device: str, dtype: Any, max_tokens: int) -> Any:
    """Random weights (seeded), built on ``device`` in ``dtype`` (an 8B model never in fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=m.hidden, intermediate_size=m.intermediate,
                         num_hidden_layers=m.layers, num_attention_heads=m.heads,
                         num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
                         vocab_size=m.vocab, max_position_embeddings=max_tokens,
                         rope_theta=500000.0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # every transformers version: parameters made in ``dtype``
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer ``i``'s (keys, values), ``[1, kv_heads, tokens, head_dim]`` (both cache APIs)."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def prefill(model: Any, ids: Any, cache: Any) -> tuple[Any, Any]:
    """Run ``ids`` over ``cache`` (filled in place); the logits of the last position only (the
    vocabulary's logits of 128K positions would not fit and are not part of a TTFT)."""
    out = model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return model.lm_head(out.last_hidden_state[:, -1]).float(), out.past_key_values


def to_pages(cache: Any, kv: dict, layers: int, block: int) -> None:
    """The model's cache of P into vLLM's paged layout, blocks 0.. in order."""
    for i in range(layers):
        k, v = layer_kv(cache, i)
        tokens = k.shape[2]
        pages = kv[f"layers.{i}"][: tokens // block]
        shape = (tokens // block, block, k.shape[1], k.shape[3])
        pages[:, 0].copy_(k[0].transpose(0, 1).reshape(shape))
        pages[:, 1].copy_(v[0].transpose(0, 1).reshape(shape))


def from_pages(kv: dict, layers: int, blocks: int, cache: Any) -> Any:
    """Paged KV (blocks 0..blocks-1) gathered into the model's cache (contiguous per layer)."""
    for i in range(layers):
        pages = kv[f"layers.{i}"][:blocks]
        n, block, heads, dim = pages.shape[0], pages.shape[2], pages.shape[3], pages.shape[4]
        k = pages[:, 0].reshape(n * block, heads, dim).transpose(0, 1).unsqueeze(0).contiguous()
        v = pages[:, 1].reshape(n * block, heads, dim).transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(k, v, i)
    return cache


def block_hashes(tokens: list[int], block: int) -> list[bytes]:
    """Chained per-block hashes of a token sequence (as vLLM's prefix caching keys)."""
    import hashlib

    out, prev = [], b"ttft"
    for b in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + repr(tokens[b * block:(b + 1) * block]).encode(),
                               digest_size=16).digest()  # fmt: skip
        out.append(prev)
    return out


def one_prefix(plan: Plan, tokens: int, device: str, model: Any, workdir: Path,
               w: RowWriter) -> dict:  # fmt: skip
    import torch
    from transformers import DynamicCache

    m, dtype = plan.model, getattr(torch, plan.dtype)
    gen = torch.Generator().manual_seed(tokens)
    prefix = torch.randint(0, m.vocab, (tokens,), generator=gen)
    suffix = torch.randint(0, m.vocab, (plan.suffix,), generator=gen)  # drawn after P: new
    blocks = tokens // plan.block
    num_blocks = blocks + plan.suffix // plan.block + 1
    kv = {f"layers.{i}": torch.zeros(num_blocks, 2, plan.block, m.kv_heads, m.head_dim,
                                     dtype=dtype, device=device) for i in range(m.layers)}  # fmt: skip
    slot = -(-m.layers * 2 * plan.block * m.kv_heads * m.head_dim * dtype.itemsize
             * (plan.chunk // plan.block) // 4096) * 4096  # fmt: skip
    chunks = blocks // (plan.chunk // plan.block)
    host_chunks = chunks // 2
    config = {"chunk_tokens": plan.chunk, "staging": "256MiB" if device == "cuda" else "4MiB",
              "devices": [{"host": {"capacity": (host_chunks + 1) * slot}},
                          {"ssd": {"path": str(workdir / f"ttft-{tokens}.kvpool"),
                                   "capacity": (chunks + 2) * slot}}]}  # fmt: skip
    from vllm_kvpool.local import LocalPool

    ids = list(range(num_blocks))
    p_ids = prefix.unsqueeze(0).to(device)
    full = torch.cat([prefix, suffix]).unsqueeze(0).to(device)
    s_ids = suffix.unsqueeze(0).to(device)
    hashes = block_hashes(prefix.tolist(), plan.block)
    all_hashes = block_hashes(torch.cat([prefix, suffix]).tolist(), plan.block)
    out: dict = {"tokens": tokens, "suffix": plan.suffix}
    with torch.inference_mode(), LocalPool(config, kv, num_blocks, plan.block,
                                           bandwidths=[4.0, 4.0], layout_id="ttft") as pool:
        t0 = time.perf_counter()
        _, cache = prefill(model, p_ids, DynamicCache())  # the earlier request that computed P
        to_pages(cache, kv, m.layers, plan.block)
        del cache
        saved_kv = {k: t[:blocks].clone() for k, t in kv.items()}  # (on the GPU: 16 GiB at 128K)
        stored = pool.save(hashes, ids[:blocks])
        cuda_sync(device)
        out["store_s"] = round(time.perf_counter() - t0, 3)
        if stored != chunks:
            raise RuntimeError(f"stored {stored} of {chunks} chunks")
        hit = sum(h.num_blocks for h in pool.pool.lookup(all_hashes)) * plan.block
        if hit != tokens:  # the pool must serve P and nothing of the new suffix
            raise RuntimeError(f"the pool's lookup of P + S hits {hit} tokens, not P's {tokens}")
        recompute, pooled, fetch_s, gather_s = [], [], [], []
        for _ in range(plan.repeats):
            cuda_sync(device)
            t0 = time.perf_counter()
            logits_ref, cache = prefill(model, full, DynamicCache())
            token_ref = int(logits_ref.argmax())
            cuda_sync(device)
            recompute.append(time.perf_counter() - t0)
            del cache
            for t in kv.values():
                t.zero_()
            cuda_sync(device)
            t0 = time.perf_counter()
            r = pool.fetch(all_hashes, ids)  # the worker's load path: P only (S misses)
            cuda_sync(device)
            t1 = time.perf_counter()
            cache = from_pages(kv, m.layers, r.blocks, DynamicCache())
            cuda_sync(device)
            t2 = time.perf_counter()
            logits, cache = prefill(model, s_ids, cache)
            token = int(logits.argmax())
            cuda_sync(device)
            pooled.append(time.perf_counter() - t0)
            fetch_s.append(t1 - t0)
            gather_s.append(t2 - t1)
            del cache
            if not r.ok or r.blocks != blocks:
                raise RuntimeError(f"fetch: {r.blocks} of {blocks} blocks, ok={r.ok}")
        exact = all(torch.equal(kv[k][:blocks].view(torch.uint8), v.view(torch.uint8))
                    for k, v in saved_kv.items())  # fmt: skip
        del saved_kv
        top2 = logits_ref.topk(2).values[0]
        out.update(recompute_s=statistics.median(recompute), pool_s=statistics.median(pooled),
                   fetch_s=statistics.median(fetch_s), gather_s=statistics.median(gather_s),
                   same_token=token == token_ref, token=token, token_recompute=token_ref,
                   top2_gap=float(top2[0] - top2[1]), byte_exact=exact,
                   kv_bytes=blocks * m.layers * 2 * plan.block * m.kv_heads * m.head_dim
                   * dtype.itemsize, served_tokens=hit, repeats=plan.repeats)  # fmt: skip
    (workdir / f"ttft-{tokens}.kvpool").unlink(missing_ok=True)
    out["speedup"] = out["recompute_s"] / out["pool_s"]
    ok = out["byte_exact"] and (out["same_token"] or device == "cuda")
    notes = []
    if not out["same_token"]:
        notes.append(f"first token {token} != recompute's {token_ref} (top-2 logit gap "
                     f"{out['top2_gap']:.3g})")  # fmt: skip
    if device == "cuda" and tokens >= 131072:
        if out["pool_s"] >= TTFT_GOAL_S or out["speedup"] < SPEEDUP_GOAL:
            notes.append(f"goal: TTFT < {TTFT_GOAL_S} s and speedup >= {SPEEDUP_GOAL}")
    w.write(test="ttft", path=f"{tokens}-token prefix + {plan.suffix} new tokens",
            bytes=out["kv_bytes"], seconds=out["pool_s"],
            gbps=out["kv_bytes"] / out["fetch_s"] / 1e9, byte_exact=out["byte_exact"],
            repeats=plan.repeats, status="ok" if ok else "error", note="; ".join(notes),
            detail={k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()})  # fmt: skip
    return out


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    import torch

    plan = DRY_PLAN if ctx.dry_run else GPU_PLAN
    workdir = Path(ctx.workdir)
    dtype = getattr(torch, plan.dtype)
    summary: dict[str, Any] = {}
    try:
        import vllm_kvpool._kvio  # noqa: F401 - built by the kvio part of an earlier command
    except ImportError:  # a fresh machine: build it as the kvio part does
        from gpucheck.parts.kvio import build_kvio

        t0 = time.perf_counter()
        summary["kvio_build"] = build_kvio(ctx.kvio_prefix, workdir / "build", ROOT / "vllm_kvpool")
        summary["kvio_build_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    model = build_model(plan.model, ctx.device, dtype, max(plan.prefixes) + plan.suffix)
    summary.update(model_build_s=round(time.perf_counter() - t0, 2),
                   attention=model.config._attn_implementation)
    for tokens in plan.prefixes:
        budget.check(f"the {tokens}-token prefix")
        try:
            res = one_prefix(plan, tokens, ctx.device, model, workdir, w)
            summary[str(tokens)] = {k: res[k] for k in ("pool_s", "recompute_s", "speedup",
                                                        "fetch_s", "same_token", "byte_exact")}
        except Exception as exc:  # noqa: BLE001 - recorded; the next prefix still runs
            w.write(test="ttft", path=f"{tokens}-token prefix", seconds=0, status="error",
                    note=error_text(exc))
            summary[f"{tokens}_error"] = error_text(exc)
            summary["_status"] = "error"
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    return summary
