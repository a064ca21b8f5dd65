"""Fetch a long prefix's KV into paged KV tensors: the unified pool vs real LMCache 0.5.6, beside
a bound measured in the same process.

Pool measurements run in one child process per (scenario, placement): it builds the KV and stores
it in the pool ONCE, then per repetition (order alternating) drops the page cache, zeroes the KV
and times, on the same engine and the same stored chunks:
  pool         the fetch as users run it (host chunks verified at save, SSD reads verified)
  pool-verify  the same with ``verify_checksums: true`` (host chunks hashed on every fetch too)
  alone:<dev>  each device's share of the prefix alone (exactly its chunks, same queue depth,
               same copy threads, same verification): the in-run bound is max over devices
               of each share's FASTEST repetition, ``frac_of_bound`` = bound / pool time, which
               exceeds 1 only by noise smaller than the parts' spread (the run says so)
  together     every share at once as ``pool`` does, the lookup and the jobs planned before the
               timer starts (the engine's side of the fetch alone): where the shares cannot
               overlap as the alone parts assume (two shared cores: the host copy's threads and
               the SSD completions compete), this is the truer bound, so the in-run bound is
               max(max over devices of alone, together), each part's minimum over the
               repetitions, never below the former
  serial       a truly serial fetch in the same engine: the host share, then the SSD share(s)
Every fetch that fills the whole prefix is checked byte-identical (XXH3-64 per layer). CPU cost is
user+sys seconds of the process (all threads) during the fetch, per GB.

Equal footing: every child, the pool's and LMCache's, runs with the same number of torch and
OpenMP threads, the pool's own ``copy_threads`` (its probe's choice, printed; the pool children
get it explicitly), and both sides are timed over the same window: from the call (the pool's
``LocalPool.fetch``, lookup and job planning included; LMCache's ``retrieve()``, hashing and
lookup included) to the last byte in the KV cache.

Rival: real LMCache 0.5.6 ``LMCacheEngine`` (LocalCPUBackend + LocalDiskBackend, chunk 256,
``use_odirect`` on/off), one child per scenario (store once; per repetition restore the
split, drop caches, retrieve; S1's buffered reads and its S1-t<k> repetitions measured by its
O_DIRECT child after its own, on the same stored files: the disk backend reads its
``use_odirect`` at every read, and the files hold the same bytes either way), through
a thin CPU adapter (its vLLM connector does not run on CPU) whose copy is a plain slice copy;
``--lmcache-kernel`` adds LMCache's own CPU copy kernel (slow on CPU; its users run the CUDA
one). LMCache verifies nothing on retrieve: ``ratio_vs_lmcache`` is against the pool with host
chunks unverified (the SSD share is always verified), ``ratio_vs_lmcache_verified`` against
``pool-verify``. Needs ``make bench-env`` (.venv-bench); skipped with the reason otherwise.

Scenarios (KV = Llama-3.1-8B geometry by default: 32 layers, 8 KV heads, head 128, bf16; 32K
tokens = 4 GiB; KV per layer [blocks, 2, block, heads, head] as vLLM's FlashInfer layout)
  S1 matched split: host holds 7/8 of the chunks, the rest on one SSD file; LMCache's CPU tier
     is sized for the whole prefix and the chunks past the host share are removed from it after
     the store, so both hold the same chunks in memory.
  S2 host smaller than the prefix (1/2): LMCache as its docs configure it (CPU tier = the host
     capacity, disk behind it); reported as its time or "did not complete in T s".
  S3 several devices: 2 host pools + an SSD file + a second "SSD" (a loop device with O_DIRECT
     over /dev/shm, read-throttled by the blkio cgroup so bandwidths differ; its kernel copies
     burn the same two cores, which the in-run bound includes because it is measured here);
     bandwidth placement vs round robin (a uniform split; the placement runs below) and, with
     --tiered, a tiered fill (host pools, then SSDs); LMCache on its one local_disk.

    .venv-bench/bin/python benchmarks/bench_kvpool.py --out out
    python benchmarks/bench_kvpool.py --tokens 4096 --reps 1       # quick look
    python benchmarks/bench_kvpool.py --model gpt-oss-20b          # per-model runs (kvpool_models.py)
Results are appended to ``<workdir>/results.jsonl`` as they come (a killed run keeps them), and
each child's wall time with its parts (start, make_kv, store, measure) as it exits (a
``"record": "child"`` line; also on stderr).
  S3p/S4 (issue #46, after S3): S3's devices, a new prefix of 1/4 the tokens per step, saved,
     fetched (then its in-run bound's parts, twice each) and dropped; round robin, probe-only
     and adaptive placement, one pool each over the same devices in one child, stepped in turn;
     S3p: the second SSD limited to half S3's read limit, its prior overstated 3x, 5 steps;
     S4: its limit cut to a third for 4 of 12 steps (after 3), then restored.
  S1-t<k>: S1 again at the copy-thread count the probe did not pick (1 or the cores), pool and
     LMCache O_DIRECT with k threads each: measured by S1's pool child and LMCache O_DIRECT
     child after their S1 repetitions, on the KV and chunks each stored there (torch's threads
     and the pool's ``copy_threads`` set in the process, each side with its own warm-up), not
     by two more children that made and stored the same 4 GiB again.

Last line: ratio_vs_lmcache=X frac_of_bound=F ratio_vs_serial=V ratio_vs_lmcache_multi=Y
           multi_frac_of_bound=W cpu_s_per_gb=C lmcache_threads=T pool_threads=T
           ratio_vs_lmcache_1t=X1 frac_of_bound_1t=F1 ratio_vs_lmcache_nt=XN frac_of_bound_nt=FN
           n_threads=N ratio_vs_rr_multi=R slowdown_recovery_fetches=K ratio_vs_rr_s4=R4
(multi_frac_of_bound: the adaptive placement's, the lower of S3p and S4; ratio_vs_rr_s4: S4's
round robin / adaptive, summed fetch seconds over all its steps, each phase logged above it)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # support/ is not installed

from support.page_cache import drop_page_cache  # noqa: E402

LMCACHE_CHUNK = 256


# ----------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """KV geometry of the model whose prefix is fetched (a parameter: other models plug in)."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    tokens: int = 32768
    chunk_tokens: int = 256

    @property
    def dtype_bytes(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    @property
    def num_blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def page_bytes(self) -> int:  # one block of one layer, K and V
        return 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens // self.block_size * self.page_bytes * self.layers

    @property
    def num_chunks(self) -> int:
        return self.tokens // self.chunk_tokens

    @property
    def prefix_bytes(self) -> int:
        return self.num_blocks * self.page_bytes * self.layers

    def check(self) -> None:
        if self.chunk_tokens % self.block_size or self.tokens % self.chunk_tokens:
            raise ValueError(f"tokens ({self.tokens}) must be a multiple of chunk_tokens "
                             f"({self.chunk_tokens}), itself a multiple of block_size "
                             f"({self.block_size})")  # fmt: skip
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: {self.dtype!r} is not bfloat16, float16 or float32")


SEED_BYTES = 16 * 2**20 + 4099  # odd: no two 4 KiB-multiple-apart pages repeat each other


def make_kv(g: Geometry) -> list[Any]:
    """Per-layer KV [blocks, 2, block_size, heads, head_dim] (vLLM FlashInfer layout), page
    aligned (torch under THP_MEM_ALLOC_ENABLE=1): a seeded random block of ``SEED_BYTES`` tiled
    over all layers. The period is odd, so pages (multiples of 4 KiB apart) never hold the same
    bytes: a chunk put back in the wrong place changes the digest. Filling GiBs with
    ``torch.randint`` took ~40 s per child; tiling is a memcpy."""
    import torch

    dtype = getattr(torch, g.dtype)
    layer_bytes = g.num_blocks * g.page_bytes
    total = g.layers * layer_bytes
    raw = torch.empty(total + 4096, dtype=torch.uint8)
    base = (-raw.data_ptr()) % 4096
    flat = raw[base : base + total]
    kv = [flat[i * layer_bytes : (i + 1) * layer_bytes].view(dtype)
          .view(g.num_blocks, 2, g.block_size, g.kv_heads, g.head_dim)
          for i in range(g.layers)]  # fmt: skip
    fill_kv(kv)
    return kv


def fill_kv(kv: list[Any]) -> None:
    """(Re)write ``make_kv``'s bytes into ``kv`` in place (a step that left it partial is put
    back without a second copy of the KV kept for it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    seed = torch.randint(0, 256, (SEED_BYTES,), dtype=torch.uint8, generator=gen)
    off = 0  # the pattern runs on across the layers, as over one buffer
    for t in kv:
        flat = t.view(-1).view(torch.uint8)
        pos = 0
        while pos < flat.numel():
            k = off % SEED_BYTES
            n = min(SEED_BYTES - k, flat.numel() - pos)
            flat[pos : pos + n].copy_(seed[k : k + n])
            pos, off = pos + n, off + n


def kv_digest(kv: list[Any]) -> list[int]:
    """XXH3-64 per layer, the layers hashed on every core (the checksum releases the GIL; the
    digest is outside every timed window)."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kvpool.native import kvio

    io = kvio()
    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as ex:
        return list(ex.map(lambda t: io.checksum(t.data_ptr(), t.numel() * t.element_size()), kv))


def block_hashes(g: Geometry, salt: str) -> list[bytes]:
    """A hash chain over the prefix's blocks (as vLLM's: each names the prefix up to it)."""
    out, prev = [], salt.encode()
    for i in range(g.num_blocks):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(prev)
    return out


# ----------------------------------------------------------------------------- systems
@dataclass
class Result:
    system: str
    scenario: str
    seconds: float | None  # None: did not complete
    nbytes: int
    cpu_s: float  # user + sys CPU seconds of the process (all its threads) during the fetch
    identical: bool
    device_bytes: dict[str, int] = field(default_factory=dict)
    device_gbps: dict[str, float] = field(default_factory=dict)
    note: str = ""
    cold: bool = True
    rep: int = 0
    threads: int = 1  # torch / OpenMP threads of the child (= the pool's copy_threads)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


_PHASE = [time.perf_counter()]


def phase(name: str) -> None:
    """A child's wall seconds since its previous mark (or its start), printed for the parent
    (``run_child`` logs each child's wall time and these parts of it)."""
    now = time.perf_counter()
    print(f"PHASE {json.dumps({'name': name, 'seconds': round(now - _PHASE[0], 3)})}",
          flush=True)  # fmt: skip
    _PHASE[0] = now


def pool_parts(names: list[str]) -> list[str]:
    """What a pool child measures per repetition (see the module docstring)."""
    return ["pool", "pool-verify", *[f"alone:{n}" for n in names], "together", "serial"]


def fetch_part(pool: Any, hashes: list, ids: list[int], part: str,
               order: list[int] | None = None) -> tuple[float, int, bool]:
    """(seconds, blocks, all verified) of one part: ``pool`` / ``pool-verify`` and
    ``alone:<device>`` time the whole ``fetch`` call (lookup, job planning, copies: the window
    LMCache's ``retrieve()`` is timed over); ``together`` is the engine's side only, planned
    before the timer; ``serial`` fetches the devices of ``order`` one after another."""
    devs = [d.name for d in pool.config.devices]

    def timed(devices: set[int] | None = None) -> tuple[float, Any]:
        start = time.perf_counter()
        r = pool.fetch(hashes, ids, devices=devices)
        return time.perf_counter() - start, r

    if part == "serial":
        runs = [timed({i}) for i in order or ()]
        return (sum(t for t, _ in runs), sum(r.blocks for _, r in runs),
                all(r.ok for _, r in runs))  # fmt: skip
    if part == "together":
        r = pool.run(pool.plan(hashes, ids))
        return r.seconds, r.blocks, r.ok
    if part.startswith("alone:"):
        seconds, r = timed({devs.index(part[6:])})
    else:
        pool.engine.loads.verify = part == "pool-verify"
        try:
            seconds, r = timed()
        finally:
            pool.engine.loads.verify = pool.config.verify_checksums
    return seconds, r.blocks, r.ok


def measure_part(pool: Any, kv: list[Any], hashes: list, ids: list[int], part: str,
                 order: list[int] | None = None, zero: bool = True
                 ) -> tuple[float, int, bool, float, dict[str, int], bool]:
    """One part measured as every part is: the KV zeroed (unless ``zero`` is False) and the
    page cache dropped first; (seconds, blocks, ok) of :func:`fetch_part`, its CPU seconds, the
    bytes it read per device and whether the drop made it cold."""
    before = {k: v.bytes_read for k, v in pool.status().transfers.devices.items()}
    for t in kv if zero else ():
        t.zero_()
    cold = drop_page_cache()
    cpu0 = _cpu()
    seconds, blocks, ok = fetch_part(pool, hashes, ids, part, order)
    cpu_s = _cpu() - cpu0
    moved = {k: v.bytes_read - before.get(k, 0)
             for k, v in pool.status().transfers.devices.items()}  # fmt: skip
    return seconds, blocks, ok, cpu_s, {k: b for k, b in moved.items() if b}, cold


def run_pool(g: Geometry, spec: dict[str, Any], emit=None) -> list[Result]:
    """The pool through its public engine API (``vllm_kvpool.local.LocalPool``): stored once,
    then ``spec["reps"]`` repetitions of every part of ``pool_parts``."""
    import torch

    from vllm_kvpool.local import LocalPool

    for d in spec["config"]["devices"]:
        if "ssd" in d and not d["ssd"]["path"].startswith("/dev/"):
            Path(d["ssd"]["path"]).unlink(missing_ok=True)  # no chunks of an earlier run
    kv = make_kv(g)
    digest = kv_digest(kv)
    phase("make_kv")
    names = {f"layers.{i}": t for i, t in enumerate(kv)}
    hashes = block_hashes(g, spec["salt"])
    ids = list(range(g.num_blocks))
    out: list[Result] = []
    with LocalPool(spec["config"], names, g.num_blocks, g.block_size,
                   bandwidths=spec.get("gbps"),
                   layout_id=f"{spec['salt']}-{spec['system']}") as pool:  # fmt: skip
        saved = pool.save(hashes, ids)
        phase("store")
        if saved != g.num_chunks:
            raise RuntimeError(f"{spec['system']}: stored {saved} of {g.num_chunks} chunks")
        devs = [d.name for d in pool.config.devices]
        # host share first, then the SSDs: the order a serial fetch takes
        order = sorted(range(len(devs)), key=lambda i: pool.config.devices[i].kind != "host")
        share = {i: sum(e.location.nbytes for e in pool.pool.index.entries.values()
                        if e.location.device == i) for i in range(len(devs))}  # fmt: skip

        serial = [i for i in order if share[i]]
        # the main run, then each extra thread count (S1-t<k>) on the same engine and stored
        # chunks: a copy-thread count is the engine's ``copy_threads`` and torch's threads, set
        # here as a fresh child would have them, with its own untimed warm-up
        for run in [{"threads": spec["threads"], "scenario": spec["scenario"],
                     "parts": spec.get("parts")}, *spec.get("extra", [])]:  # fmt: skip
            torch.set_num_threads(run["threads"])
            pool.engine.loads.copy_threads = run["threads"]
            parts = [q for p in run["parts"] or pool_parts(devs)
                     for q in ([f"alone:{n}" for n in devs] if p == "alone:*" else [p])]  # fmt: skip
            parts = [p for p in parts if not p.startswith("alone:") or share[devs.index(p[6:])]]
            fetch_part(pool, hashes, ids, "pool")  # untimed warm-up: first-touch costs are not
            # the fetch's (LMCache's warm-up too)
            for rep in range(spec["reps"]):
                for part in parts if rep % 2 == 0 else parts[::-1]:
                    alone = part.startswith("alone:")
                    # a share alone is checked by its blocks and their checksums, not against
                    # the digest, so the KV is not zeroed for it (as in the placement steps)
                    seconds, blocks, ok, cpu_s, moved, cold = measure_part(
                        pool, kv, hashes, ids, part, serial, zero=not alone)  # fmt: skip
                    if alone:
                        want = share[devs.index(part[6:])] // g.chunk_bytes * g.chunk_tokens \
                            // g.block_size  # fmt: skip
                        identical = ok and blocks == want
                    else:
                        identical = ok and blocks == g.num_blocks and kv_digest(kv) == digest
                    name = spec["system"] if part == "pool" else part
                    r = Result(name, run["scenario"], seconds, sum(moved.values()), cpu_s,
                               identical, moved, {k: b / seconds / 1e9 for k, b in moved.items()},
                               cold=cold, rep=rep, threads=torch.get_num_threads())  # fmt: skip
                    out.append(r)
                    if emit is not None:
                        emit(r)
        phase("measure")
    return out


def set_throttle(throttle: dict[str, Any] | None, mbps: int) -> None:
    """Set the second SSD's read limit (the cgroup file ``Devices.setup`` wrote) mid-run."""
    if throttle:
        Path(throttle["file"]).write_text(f"{throttle['device']} {throttle['prefix']}"
                                          f"{mbps * 10**6}\n")  # fmt: skip


BOUND_REPS = 2  # placement runs: each part of the in-run bound measured this often per step


def run_placement(g: Geometry, spec: dict[str, Any], emit=None) -> list[Result]:
    """Placement that follows the devices (issue #46): one pool per policy of
    ``spec["policies"]`` (``round_robin``, ``probe-only``: bandwidth placement on the prior,
    never learning, ``adaptive``: on the estimate measured in service), all open at once over
    the SAME devices (one SSD file, one loop device: each pool's chunks are its own, ignored by
    the others, whose slots are erased before reuse), stepped in turn (the order rotating per
    step): a policy's step saves a NEW prefix (placed by its pool's weights), fetches it as
    ``pool``, then measures the in-run bound's parts (each device's share alone and
    ``together``, ``spec["bound_reps"]`` times each) and drops the prefix. Interleaving puts
    every policy on the disk as it is at that moment (the SSD file's speed drifts by tens of
    percent between minutes: in one quiet run 1.9 GB/s for one child, 1.35 for the next, which
    had made the policies' children incomparable). ``spec["runs"]``: the scenarios, in turn on
    the same pools and KV (made once), each from its prior ``gbps`` with nothing learned
    (fresh weights; every step leaves the pools empty); its ``throttle_mbps[step]`` sets the
    second SSD's read limit before the step (S4: slowed to a third, then back). Only ``pool``
    fetches teach a pool its bandwidths, as a serving pool's fetches would: the bound's parts
    (a share read alone runs at another queue depth and burst state) are measured and their
    observations then discarded. Results: scenario ``<scenario>:<policy>``, rep = step."""
    from vllm_kvpool.local import LocalPool
    from vllm_kvpool.placement import DeviceWeights

    for d in spec["policies"][0]["config"]["devices"]:
        if "ssd" in d and not d["ssd"]["path"].startswith("/dev/"):
            Path(d["ssd"]["path"]).unlink(missing_ok=True)
    kv = make_kv(g)
    digest = kv_digest(kv)
    phase("make_kv")
    # what every save stores: a step leaves the KV whole (its whole fetches are checked against
    # the digest; a share alone is fetched without zeroing the KV first: its check is the
    # blocks read and their checksums), else ``fill_kv`` puts it back
    names = {f"layers.{i}": t for i, t in enumerate(kv)}
    out: list[Result] = []
    runs = spec["runs"]
    with contextlib.ExitStack() as stack:
        pools = {p["policy"]: stack.enter_context(LocalPool(
            p["config"], names, g.num_blocks, g.block_size, bandwidths=runs[0]["gbps"],
            layout_id=f"placement:{p['policy']}")) for p in spec["policies"]}  # fmt: skip
        order = list(pools)
        for run in runs:
            for pool in pools.values():  # the scenario's prior, nothing learned (each step
                # leaves the pool empty: ``_placement_step`` clears it)
                probe = pool.config.probe
                pool.pool.weights = DeviceWeights(run["gbps"], probe.learn_after, probe.half_life)
            for step, mbps in enumerate(run["throttle_mbps"]):
                set_throttle(spec.get("throttle"), mbps)
                k = step % len(order)
                for policy in order[k:] + order[:k]:
                    res = _placement_step(g, pools[policy], kv, digest,
                                          f"{run['scenario']}:{policy}", step, mbps,
                                          spec.get("bound_reps", BOUND_REPS), emit)  # fmt: skip
                    out += res
                    if not all(r.identical for r in res):  # the next save must store the prefix
                        fill_kv(kv)
            set_throttle(spec.get("throttle"), run["throttle_mbps"][0])
            phase(f"measure {run['scenario']}")
    return out


def guard_state(pool: Any) -> dict[str, Any]:
    """The split guard's state (``split_guard``) after a fetch, for the step's record: whether a
    challenger is on trial (its shares), the wait, the step, how many splits it remembers as
    slower, the noise band, how many champions from before device changes it keeps, and the
    champion's latest seconds per GiB, whole and per device (what its device-change test
    compares)."""
    from vllm_kvpool.split_guard import shares

    guard = pool.pool.weights.guard
    gib = 2**30
    return {"challenger": None if guard.challenger is None
            else [round(x, 3) for x in shares(guard.challenger.weights)],
            "wait": guard.wait, "step": guard.step, "slower": len(guard.slower),
            "band": round(guard.band(), 3), "before": len(guard.before),
            "champion_s_per_gib": None if guard.champion.seconds_per_byte is None
            else round(guard.champion.seconds_per_byte * gib, 4),
            "devices_s_per_gib": [None if d is None else round(d * gib, 4)
                                  for d in guard.devices]}  # fmt: skip


def _placement_step(g: Geometry, pool: Any, kv: list[Any], digest: list[int], scenario: str,
                    step: int, mbps: int, bound_reps: int, emit) -> list[Result]:  # fmt: skip
    """One policy's step of :func:`run_placement`."""
    import copy

    import torch

    ids = list(range(g.num_blocks))
    hashes = block_hashes(g, f"{scenario}-{step}")
    if pool.save(hashes, ids) != g.num_chunks:
        raise RuntimeError(f"{scenario}: step {step} stored fewer than {g.num_chunks}")
    usage = pool.status().usage
    weights = [round(u.weight_gbps, 3) for u in usage]  # the estimates (they propose the split)
    kept = [round(u.kept_share or 0.0, 3) for u in usage]  # the split the guard keeps
    devs = [d.name for d in pool.config.devices]
    # the bound's parts: each SSD's share alone and ``together``. The host pools' shares alone
    # (a quarter of the prefix each at several GB/s) are never the slowest part; leaving them
    # out can only lower the bound (max over parts), and saves 4 of 11 fetches a step.
    held = sorted({e.location.device for e in pool.pool.index.entries.values()
                   if pool.config.devices[e.location.device].kind != "host"})  # fmt: skip
    bound = [*[f"alone:{devs[d]}" for d in held], "together"]
    out = []
    learned = None
    for i, part in enumerate(["pool", *[p for r in range(bound_reps)
                                        for p in (bound if r % 2 == 0 else bound[::-1])]]):
        if i == 1:  # what the pool's own fetch taught it; the bound's parts must not teach
            learned = copy.deepcopy(pool.pool.weights)
        alone = part.startswith("alone:")
        # only a whole fetch is checked against the digest, so only it needs the KV zeroed
        # first (zeroing 1 GiB took ~0.25 s a part on this VM, a fifth of a step's time)
        seconds, blocks, ok, cpu_s, moved, cold = measure_part(pool, kv, hashes, ids, part,
                                                               zero=not alone)
        identical = ok and (alone or (blocks == g.num_blocks and kv_digest(kv) == digest))
        note = {"throttle_mbps": mbps, "weights": weights, "kept_share": kept}
        if i == 0:  # what the guard made of the pool's fetch (diagnosis: which rule held a split)
            note["guard"] = guard_state(pool)
        res = Result(part, scenario, seconds, sum(moved.values()), cpu_s, identical, moved,
                     {k: b / seconds / 1e9 for k, b in moved.items()}, cold=cold, rep=step,
                     threads=torch.get_num_threads(), note=json.dumps(note))  # fmt: skip
        out.append(res)
        if emit is not None:
            emit(res)
    if learned is not None:  # measure_part applied the parts' reports: forget them
        pool.pool.weights = learned
    pool.pool.clear()  # the next step's prefix finds the same free capacity
    return out


def _lmcache_adapter(kv: list[Any], g: Geometry, copy: str) -> Any:
    """LMCache's GPU-connector interface over CPU KV tensors (its vLLM connector has none)."""
    import torch
    from lmcache import device_ops
    from lmcache.lmcache_native import EngineKVFormat, TransferDirection
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryFormat

    hd = g.kv_heads * g.head_dim
    flat = [t.view(g.num_blocks, 2, g.block_size, hd) for t in kv]

    def runs(slots: Any) -> list[tuple[int, int, int]]:
        """(first token in the chunk, first block, blocks) of consecutive block runs."""
        blocks = (slots[:: g.block_size] // g.block_size).tolist()
        out, start = [], 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                out.append((start * g.block_size, blocks[start], i - start))
                start = i
        return out

    class CPUAdapter(GPUConnectorInterface):
        def get_shape(self, num_tokens: int) -> Any:
            return torch.Size([2, g.layers, num_tokens, hd])

        def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
            pass

        def to_gpu(self, obj: Any, start: int, end: int, **kwargs: Any) -> None:
            slots = kwargs["slot_mapping"][start:end]
            if copy == "kernel":
                device_ops.multi_layer_kv_transfer(
                    obj.tensor, flat, slots, torch.device("cpu"), g.num_blocks * g.block_size,
                    TransferDirection.H2D, EngineKVFormat.NL_X_NB_TWO_BS_NH_HS,
                    block_size=g.block_size, head_size=g.head_dim)  # fmt: skip
                return
            for tok, b0, nb in runs(slots):
                n = nb * g.block_size
                for layer, t in enumerate(flat):
                    src = obj.tensor[:, layer, tok : tok + n].view(2, nb, g.block_size, hd)
                    t[b0 : b0 + nb].copy_(src.transpose(0, 1))

        def from_gpu(self, obj: Any, start: int, end: int, **kwargs: Any) -> None:
            slots = kwargs["slot_mapping"][start:end]
            for tok, b0, nb in runs(slots):
                n = nb * g.block_size
                for layer, t in enumerate(flat):
                    dst = obj.tensor[:, layer, tok : tok + n].view(2, nb, g.block_size, hd)
                    dst.copy_(t[b0 : b0 + nb].transpose(0, 1))
            obj.metadata.fmt = MemoryFormat.KV_2LTD

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for o, s, e in zip(objs, starts, ends, strict=True):
                self.to_gpu(o, s, e, **kwargs)

        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for o, s, e in zip(objs, starts, ends, strict=True):
                self.from_gpu(o, s, e, **kwargs)

    return CPUAdapter()


def run_lmcache(g: Geometry, spec: dict[str, Any], emit=None) -> list[Result]:
    """Real LMCache: store through its engine ONCE, keep ``resident`` leading chunks in its CPU
    tier (the rest only on its disk), then ``spec["reps"]`` cold ``retrieve`` calls. A retrieve
    promotes disk chunks into the CPU tier (``StorageManager.get``), so the split is restored
    before each repetition; with ``resident`` None (LMCache as its docs configure it) the tier
    keeps whatever LMCache's own policy kept."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    disk_dir = Path(spec["disk_dir"])
    shutil.rmtree(disk_dir, ignore_errors=True)
    disk_dir.mkdir(parents=True)
    kv = make_kv(g)
    digest = kv_digest(kv)
    phase("make_kv")
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=LMCACHE_CHUNK, local_cpu=True, max_local_cpu_size=spec["cpu_gib"],
        local_disk=f"file://{disk_dir}/", max_local_disk_size=spec["disk_gib"],
        extra_config={"use_odirect": spec["odirect"]})  # fmt: skip
    meta = LMCacheMetadata(model_name=spec["salt"], world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=getattr(torch, g.dtype),
                           kv_shape=(g.layers, 2, LMCACHE_CHUNK, g.kv_heads, g.head_dim))  # fmt: skip
    engine = LMCacheEngineBuilder.get_or_create("bench", config, meta,
                                                _lmcache_adapter(kv, g, spec["copy"]), None, None)  # fmt: skip
    out: list[Result] = []
    try:
        engine.post_init()
        gen = torch.Generator().manual_seed(int(hashlib.md5(spec["salt"].encode()).hexdigest()[:7], 16))
        tokens = torch.randint(3, 32000, (g.tokens,), generator=gen)
        slots = torch.arange(g.tokens)
        engine.store(tokens, slot_mapping=slots)
        keys = [k for _, _, k in engine.token_database.process_tokens(tokens=tokens)]
        sm = engine.storage_manager
        disk = sm.storage_backends["LocalDiskBackend"]
        cpu = sm.storage_backends["LocalCPUBackend"]
        deadline, last, stable = time.monotonic() + 600, -1, 0
        while (on_disk := sum(disk.contains(k) for k in keys)) < len(keys):  # write-through
            stable = stable + 1 if on_disk == last else 0
            if stable > 100 or time.monotonic() > deadline:  # a full CPU tier drops stores
                break
            last = on_disk
            time.sleep(0.05)
        phase("store")
        # the main run, then each extra run on the same engine and stored chunks, with its own
        # untimed warm-up: another thread count (S1-t<k>: torch's threads set as a fresh
        # child's) or another ``use_odirect`` (the disk backend reads the flag at each read,
        # and the files an O_DIRECT store wrote hold the same bytes a buffered one writes)
        for run in [{}, *spec.get("extra", [])]:
            torch.set_num_threads(run.get("threads", spec["threads"]))
            disk.use_odirect = run.get("odirect", spec["odirect"])
            system = run.get("system", spec["system"])
            for rep in range(-1, spec.get("reps", 1)):  # rep -1: untimed warm-up, as the pool's
                if spec.get("resident") is not None:  # matched split: only the host share in memory
                    for k in keys[spec["resident"] :]:
                        if cpu.contains(k):
                            sm.remove(k, ["LocalCPUBackend"])
                in_cpu = 0
                while in_cpu < len(keys) and cpu.contains(keys[in_cpu]):
                    in_cpu += 1
                cold = drop_page_cache()
                for t in kv:
                    t.zero_()
                cpu0, start = _cpu(), time.perf_counter()
                done: list[Any] = []
                worker = threading.Thread(target=lambda out=done: out.append(
                    engine.retrieve(tokens, slot_mapping=slots)), daemon=True)  # fmt: skip
                worker.start()
                worker.join(spec.get("retrieve_timeout"))
                seconds = time.perf_counter() - start
                if not done:  # LMCache is stuck: report it, leave without waiting for its threads
                    note = (f"did not complete in {spec['retrieve_timeout']:.0f} s ({on_disk}/"
                            f"{len(keys)} chunks on its disk, {in_cpu} leading chunks in its CPU "
                            "tier)")  # fmt: skip
                    print("RESULT " + json.dumps(asdict(Result(
                        system, run.get("scenario", spec["scenario"]), None, g.prefix_bytes,
                        0.0, False,
                        note=note, rep=max(rep, 0)))), flush=True)  # fmt: skip
                    os._exit(0)
                cpu_s = _cpu() - cpu0
                got = int(done[0].sum())
                identical = got == g.tokens and kv_digest(kv) == digest
                moved = got * g.chunk_bytes // g.chunk_tokens
                cb = min(in_cpu * g.chunk_bytes, moved)
                dev = {"lmcache-cpu": cb, "lmcache-disk": moved - cb}
                note = "" if got == g.tokens else (f"partial hit: retrieved {got} of {g.tokens} "
                                                   "tokens (the rest would be recomputed)")  # fmt: skip
                r = Result(system, run.get("scenario", spec["scenario"]), seconds, moved, cpu_s,
                           identical,
                           {k: b for k, b in dev.items() if b},
                           {k: b / seconds / 1e9 for k, b in dev.items() if b}, note, cold, rep,
                           torch.get_num_threads())  # fmt: skip
                if rep < 0:
                    continue
                out.append(r)
                if emit is not None:
                    emit(r)
        phase("measure")
    finally:
        LMCacheEngineBuilder.destroy("bench")
        shutil.rmtree(disk_dir, ignore_errors=True)
    return out


def child_main(payload: str) -> int:
    job = json.loads(payload)
    g = Geometry(**job["geometry"])
    spec = job["spec"]
    if spec.get("cgroup"):  # the throttled loop device's limit applies to this process
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    import torch

    torch.set_num_threads(spec["threads"])  # LMCache's torch copies get the pool's threads
    phase("start")  # the interpreter and torch

    def emit(r: Result) -> None:
        print("RESULT " + json.dumps(asdict(r)), flush=True)

    if spec["system"].startswith("lmcache"):
        run_lmcache(g, spec, emit)
    elif spec["system"] == "placement":
        run_placement(g, spec, emit)
    else:
        run_pool(g, spec, emit)
    return 0


# ----------------------------------------------------------------------------- devices
@dataclass
class Devices:
    """The second SSD of S3: a loop device over /dev/shm (else a posix file there)."""

    second: str | None = None  # /dev/loopN (uring) or a /dev/shm file (posix)
    second_backend: str = "uring"
    second_note: str = ""
    cgroup: str | None = None
    throttle: dict[str, Any] | None = None  # what ``set_throttle`` writes: file, device, prefix
    _loop: str | None = None
    _backing: Path | None = None

    @classmethod
    def setup(cls, second_bytes: int, throttle_mbps: int, log) -> Devices:
        dev = cls()
        backing = Path("/dev/shm/bench_kvpool_ssd1.img")
        try:
            with open(backing, "wb") as f:
                f.truncate(second_bytes)
            loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(backing)],
                                  check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError) as exc:
            dev.second, dev.second_backend, dev._backing = str(backing), "posix", backing
            dev.second_note = f"posix file on /dev/shm (loop device unavailable: {exc})"
            log(f"second SSD: {dev.second_note}")
            return dev
        dev._loop, dev._backing, dev.second = loop, backing, loop
        dev.second_note = f"{loop} (losetup --direct-io=on over /dev/shm)"
        # cgroup v2 io.max needs the io controller on the unified hierarchy; where it is bound to
        # v1 (as on this VM) v1 blkio throttling is the same kernel limiter (blk-throttle).
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        io_v2 = v2.exists() and "io" in v2.read_text().split()
        blkio = Path("/sys/fs/cgroup/blkio")
        major_minor = Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()
        try:
            if io_v2:
                cg = Path("/sys/fs/cgroup/bench_kvpool")
                cg.mkdir(exist_ok=True)
                (cg / "io.max").write_text(f"{major_minor} rbps={throttle_mbps * 10**6}\n")
                dev.throttle = {"file": str(cg / "io.max"), "device": major_minor,
                                "prefix": "rbps="}  # fmt: skip
                how = "cgroup v2 io.max"
            elif blkio.is_dir():
                cg = blkio / "bench_kvpool"
                cg.mkdir(exist_ok=True)
                (cg / "blkio.throttle.read_bps_device").write_text(
                    f"{major_minor} {throttle_mbps * 10**6}\n")
                dev.throttle = {"file": str(cg / "blkio.throttle.read_bps_device"),
                                "device": major_minor, "prefix": ""}  # fmt: skip
                how = ("cgroup v1 blkio.throttle.read_bps_device (v2 io.max unavailable here: the "
                       "io controller is bound to the v1 hierarchy)")  # fmt: skip
            else:
                raise OSError("no io/blkio cgroup controller")
            dev.cgroup = str(cg)
            dev.second_note += f", reads throttled to {throttle_mbps} MB/s by {how}"
        except OSError as exc:
            dev.second_note += f", NOT throttled ({exc})"
        log(f"second SSD: {dev.second_note}")
        return dev

    def close(self) -> None:
        if self.cgroup:
            with contextlib.suppress(OSError):  # leave it first: a cgroup with members stays
                Path(self.cgroup).parent.joinpath("cgroup.procs").write_text(str(os.getpid()))
                Path(self.cgroup).rmdir()
        if self._loop:
            subprocess.run(["losetup", "-d", self._loop], check=False)
        if self._backing is not None:
            self._backing.unlink(missing_ok=True)



# ----------------------------------------------------------------------------- orchestration
def run_child(g: Geometry, spec: dict[str, Any], timeout: float, sink) -> list[Result]:
    """Run one child; each result goes to ``sink`` as soon as the child prints it. Every
    child, the pool's and LMCache's, runs with ``spec["threads"]`` torch and OpenMP threads:
    the pool's ``copy_threads`` (same CPU budget for both sides)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "THP_MEM_ALLOC_ENABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    payload = json.dumps({"geometry": asdict(g), "spec": spec})
    workdir = Path(spec.get("workdir", "/tmp"))
    err_path = workdir / "child.err"
    phases: dict[str, float] = {}
    start = time.perf_counter()
    with open(err_path, "w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--child", payload], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        timer = threading.Timer(timeout, proc.kill)  # exactly the child this run started
        timer.start()
        results = []
        try:
            assert proc.stdout is not None
            for ln in proc.stdout:
                if ln.startswith("RESULT "):
                    r = Result(**json.loads(ln[7:]))
                    results.append(r)
                    sink(r)
                elif ln.startswith("PHASE "):
                    mark = json.loads(ln[6:])
                    phases[mark["name"]] = phases.get(mark["name"], 0.0) + mark["seconds"]
            proc.wait()
        finally:
            timer.cancel()
        err.seek(0)
        log = err.read()
    child_time(workdir, spec, time.perf_counter() - start, phases)
    stuck = [x for x in log.splitlines() if "No eviction candidates" in x or "Waiting" in x]
    if proc.returncode != 0 and not results:
        if proc.returncode == -9:
            line = stuck[-1].strip() if stuck else (log.strip().splitlines() or ["(no log)"])[-1]
            r = Result(spec["system"], spec["scenario"], None, g.prefix_bytes, 0.0, False,
                       note=f"did not complete in {timeout:.0f} s; its log: {line[-240:]}",
                       rep=spec.get("rep", 0))  # fmt: skip
            sink(r)
            return [r]
        raise RuntimeError(f"{spec['system']} ({spec['scenario']}) failed:\n{log[-3000:]}")
    for r in results:
        if r.seconds is None and stuck:
            r.note += f"; its log, {len(stuck)} times: {stuck[-1].strip()[-200:]}"
    return results


def child_time(workdir: Path, spec: dict[str, Any], wall: float, phases: dict[str, float]) -> None:
    """One child's wall seconds and its parts (``phase``), on stderr and appended to the
    results file (a ``"record": "child"`` line) as soon as it exits."""
    rec = {"record": "child", "scenario": spec["scenario"], "system": spec["system"],
           "wall_s": round(wall, 2), "phases": {k: round(v, 2) for k, v in phases.items()}}  # fmt: skip
    print(f"[{spec['scenario']}] child {spec['system']}: {wall:.1f} s wall ("
          + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + ")",
          file=sys.stderr, flush=True)  # fmt: skip
    with open(workdir / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def lmcache_available() -> str | None:
    """None when LMCache runs here, else why not."""
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"lmcache not importable ({type(exc).__name__}: {exc}); run `make bench-env`"
    return None


def pool_config(g: Geometry, devices: list[dict[str, Any]], placement: str) -> dict[str, Any]:
    return {"chunk_tokens": g.chunk_tokens, "placement": placement, "staging": "256MiB",
            "probe": {"seconds": 0.5, "size": "512MiB"}, "devices": devices}  # fmt: skip


def slot(g: Geometry) -> int:
    return -(-g.chunk_bytes // 4096) * 4096


def probe(g: Geometry, config: dict[str, Any]) -> list[float]:
    """The product's own probe (host memcpy, SSD O_DIRECT reads), as placement weights."""
    from vllm_kvpool.config import load_pool_config
    from vllm_kvpool.layout import ChunkLayout
    from vllm_kvpool.probe import probe_bandwidths

    bpc = g.chunk_tokens // g.block_size
    return probe_bandwidths(load_pool_config(config), ChunkLayout.uniform(g.chunk_bytes // bpc, bpc))


def copy_threads(config: dict[str, Any]) -> int:
    """The pool's own choice of memcpy threads for a fetch (``probe_copy_threads``)."""
    from vllm_kvpool.config import load_pool_config
    from vllm_kvpool.probe import probe_copy_threads

    return probe_copy_threads(load_pool_config(config))


def scenarios(g: Geometry, args: argparse.Namespace, dev: Devices | None,
              lmc_reason: str | None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per scenario: the pool's devices, the pool children (placement, parts), LMCache's runs."""
    n, s = g.num_chunks, slot(g)
    wd = args.workdir
    ssd0 = {"ssd": {"path": str(wd / "ssd0.kvpool"), "backend": "uring", "capacity": (n + 1) * s}}
    host1 = max(1, round(n * args.host_fraction))
    host2 = max(1, round(n * args.small_host_fraction))
    lmc_gib = (n + 4) * g.chunk_bytes / 2**30  # whole prefix + slack: its disk reads stage here
    base = {"disk_dir": str(wd / "lmcache_disk"), "disk_gib": lmc_gib, "cpu_gib": lmc_gib}
    lmc: list[dict[str, Any]] = []
    if lmc_reason is None:
        # buffered reads measured by the O_DIRECT child on the files it stored (``run_lmcache``)
        lmc = [{**base, "system": "lmcache-slice-odirect", "copy": "slice", "odirect": True,
                "resident": host1,
                "extra": [{"system": "lmcache-slice-buffered", "odirect": False}]}]  # fmt: skip
        if args.lmcache_kernel:
            lmc.append({**base, "system": "lmcache-kernel-odirect", "copy": "kernel",
                        "odirect": True, "resident": host1, "reps": 1})  # fmt: skip
    full = [("pool", "bandwidth", None)]
    out: dict[str, dict[str, Any]] = {
        "S1": {"devices": [{"host": {"capacity": host1 * s}}, ssd0], "pools": full, "lmcache": lmc}}
    s2_lmc = []
    if lmc_reason is None:  # as LMCache's docs configure it: CPU tier = the host memory
        s2_lmc = [{**base, "system": "lmcache-docs-odirect", "copy": "slice", "odirect": True,
                   "cpu_gib": host2 * g.chunk_bytes / 2**30, "resident": None, "reps": 1,
                   "retrieve_timeout": args.lmcache_timeout}]  # fmt: skip
    out["S2"] = {"devices": [{"host": {"capacity": host2 * s}}, ssd0], "pools": full,
                 "lmcache": s2_lmc}  # fmt: skip
    if args.spdk_trid:  # S1 with its SSD share on an SPDK namespace instead of io_uring
        spdk = {"ssd": {"name": "spdk0", "path": "spdk0", "backend": "spdk",
                        "spdk_trid": args.spdk_trid, "capacity": (n - host1 + 8) * s}}  # fmt: skip
        out["S1-spdk"] = {"devices": [{"host": {"capacity": host1 * s}}, spdk], "pools": full,
                          "lmcache": []}  # fmt: skip
    if dev is not None and dev.second is not None:
        s3_lmc = [{**lmc[0], "resident": host2, "extra": []}] if lmc else []
        out["S3"] = {"devices": s3_devices(g, args, dev), "lmcache": s3_lmc,
                     "pools": [*full, *([("pool-tiered", "single_tier_serial", ["pool"])]
                                        if args.tiered else [])]}  # fmt: skip
    return out


def s3_devices(g: Geometry, args: argparse.Namespace, dev: Devices) -> list[dict[str, Any]]:
    """S3's pool: two host pools holding ``small_host_fraction`` of the prefix, the SSD file and
    the throttled second SSD (each able to hold all of it)."""
    n, s = g.num_chunks, slot(g)
    host = max(1, round(n * args.small_host_fraction))
    h = max(1, host // 2)
    return [{"host": {"capacity": h * s, "numa_node": 0}},
            {"host": {"capacity": (host - h) * s, "numa_node": 0}},
            {"ssd": {"path": str(args.workdir / "ssd0.kvpool"), "backend": "uring",
                     "capacity": (n + 1) * s}},
            {"ssd": {"path": dev.second, "backend": dev.second_backend, "capacity": (n + 1) * s}}]


PRIOR_ERROR = 3.0  # S3's wrong prior: the second SSD rated this many times its probed speed
S4_BEFORE, S4_SLOWED = 3, 4  # S4's steps before the slowdown and slowed (then the recovered ones)
POLICIES = (("rr", "round_robin", None), ("probe-only", "bandwidth", 2**60),
            ("adaptive", "bandwidth", None))  # (name, placement, probe.learn_after override)


def run_placements(g: Geometry, args: argparse.Namespace, dev: Devices, gbps: list[float],
                   threads: int, cgroup: str | None, log, sink) -> None:  # fmt: skip
    """Issue #46's placement runs on S3's devices, 1/``placement_divisor`` of the prefix per
    step (a new prefix saved, fetched with its in-run bound, dropped): S3p, the second SSD's
    prior wrong by ``PRIOR_ERROR`` (overstated, as the probe once rated it) on static devices;
    S4, the second SSD slowed to a third of its limit mid-run and back. Round robin,
    probe-only and adaptive placement each."""
    small = Geometry(**{**asdict(g), "tokens": g.tokens // args.placement_divisor})
    wrong = [*gbps[:3], gbps[3] * PRIOR_ERROR]
    t = args.throttle_mbps
    # S3p: the second SSD held at half S3's limit (slower than the SSD file, so where chunks go
    # matters), its prior overstated: the probe-only pool overloads it, round robin splits
    # evenly, the adaptive one should learn its speed.
    plans = {"S3p": (wrong, [t // 2] * args.placement_steps),
             "S4": (gbps, [t] * S4_BEFORE + [t // 3] * S4_SLOWED + [t] * args.s4_recovered_steps)}
    log(f"[S3p] the second SSD's read limit {t // 2} MB/s, its prior: {gbps[3]:.2f} x "
        f"{PRIOR_ERROR:g} = {wrong[3]:.2f} GB/s")
    log(f"[S4] the second SSD's read limit per step (MB/s): {plans['S4'][1]}")
    policies = []
    for policy, placement, learn_after in POLICIES:
        config = {**pool_config(small, s3_devices(small, args, dev), placement),
                  "copy_threads": threads}  # fmt: skip
        if learn_after is not None:
            config["probe"] = {**config["probe"], "learn_after": learn_after}
        policies.append({"policy": policy, "config": config})
    # one child for both: its pools (and KV) made once, each scenario starting them from its
    # own prior with nothing learned (``run_placement``)
    start = time.perf_counter()
    runs = [{"scenario": sc, "gbps": prior, "throttle_mbps": schedule}
            for sc, (prior, schedule) in plans.items()]  # fmt: skip
    run_child(small, {"system": "placement", "scenario": "+".join(plans), "runs": runs,
                      "policies": policies, "threads": threads, "cgroup": cgroup,
                      "throttle": dev.throttle, "workdir": str(args.workdir)},
              args.timeout * len(runs), sink)  # fmt: skip
    log(f"[{'+'.join(plans)}] {sum(len(r['throttle_mbps']) for r in runs)} steps x "
        f"{len(policies)} policies: {time.perf_counter() - start:.0f} s")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    return f"{med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def run(args: argparse.Namespace, log=print) -> str:
    g = args.geometry
    args.workdir.mkdir(parents=True, exist_ok=True)
    from vllm_kvpool.probe import copy_thread_counts

    lmc_reason = "disabled (--no-lmcache)" if args.no_lmcache else lmcache_available()
    log(f"KV: {g.tokens} tokens x {g.layers} layers x {g.kv_heads} KV heads x head {g.head_dim}, "
        f"{g.dtype}, block {g.block_size} = {g.prefix_bytes / 2**30:.2f} GiB in {g.num_chunks} "
        f"chunks of {g.chunk_tokens} tokens ({g.chunk_bytes / 2**20:.0f} MiB)")
    log(f"LMCache: {'lmcache 0.5.6 (real)' if lmc_reason is None else 'SKIPPED: ' + lmc_reason}")
    log("vLLM OffloadingConnector: not runnable here ('CPU Offloading is currently only supported "
        "on CUDA-alike and XPU GPUs', vllm/v1/kv_offload/cpu/spec.py)")
    dev = None
    if not args.no_multi and (args.scenarios is None or "S3" in args.scenarios):
        dev = Devices.setup((g.num_chunks + 2) * slot(g) + (80 << 20), args.throttle_mbps, log)
    results: dict[str, list[Result]] = {}
    jsonl = args.workdir / "results.jsonl"

    def sink(r: Result) -> None:
        results.setdefault(f"{r.scenario}/{r.system}", []).append(r)
        with open(jsonl, "a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
        shown = f"{r.seconds:.3f} s {r.gbps:5.2f} GB/s" if r.seconds else r.note
        log(f"[{r.scenario} rep {r.rep}] {r.system:24s} {shown}  cpu {r.cpu_s:.2f} s  "
            f"identical={r.identical} cold={r.cold} GiB "
            f"{ {k: round(v / 2**30, 2) for k, v in r.device_bytes.items()} }")
        if r.note.startswith("partial"):
            log(f"[{r.scenario} rep {r.rep}] {r.system}: {r.note}")
        elif r.seconds is not None and not r.identical:
            raise RuntimeError(f"{r.system} ({r.scenario}): fetched KV differs from the stored KV")

    try:
        for name, sc in scenarios(g, args, dev, lmc_reason).items():
            if args.scenarios and name not in args.scenarios:
                continue
            cgroup = dev.cgroup if (dev is not None and name == "S3") else None
            if cgroup:  # probe (and run) under the second SSD's throttle
                Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
            gbps = probe(g, pool_config(g, sc["devices"], "bandwidth"))
            threads = copy_threads(pool_config(g, sc["devices"], "bandwidth"))
            log(f"[{name}] copy threads (the pool's probe): {threads}, for every child")
            log(f"[{name}] devices (probed GB/s, placement weights): " + ", ".join(
                f"{next(iter(d))} {d[next(iter(d))].get('path', 'memory')} {b:.2f}"
                for d, b in zip(sc["devices"], gbps, strict=True)))  # fmt: skip
            other = 1 if threads > 1 else copy_thread_counts(len(os.sched_getaffinity(0)))[-1]
            extra = None
            if name == "S1" and other != threads and not args.no_thread_sweep:
                # S1 again at the other thread count, both sides equal: the pool and LMCache
                # O_DIRECT, each in its S1 child, on the chunks it stored there
                log(f"[S1-t{other}] S1 with {other} copy thread(s) on both sides (in S1's pool "
                    "and LMCache O_DIRECT children, after their S1 repetitions)")
                extra = {"threads": other, "scenario": f"S1-t{other}",
                         "parts": ["pool", "alone:*", "together"]}  # fmt: skip
            run_scenario(g, args, name, sc, threads, gbps, cgroup, sink, extra)
            if name == "S3" and dev is not None and not args.no_placement:
                run_placements(g, args, dev, gbps, threads, cgroup, log, sink)
    finally:
        if dev is not None:
            dev.close()
        (args.workdir / "ssd0.kvpool").unlink(missing_ok=True)
    return summarize(g, results, args, log)


def run_scenario(g: Geometry, args: argparse.Namespace, name: str, sc: dict[str, Any],
                 threads: int, gbps: list[float], cgroup: str | None, sink,
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
    """The children of one scenario: the pool's (one per placement) and LMCache's, all with
    ``threads`` torch/OpenMP/copy threads. ``extra`` (S1-t<k>): another thread count measured
    by the first pool child and the first LMCache child after their own repetitions, on the
    KV and chunks they stored (``parts`` the pool's), each with its own warm-up."""
    pools = [{"system": system, "scenario": name, "salt": f"{name}-{system}",
              "config": {**pool_config(g, sc["devices"], placement), "copy_threads": threads},
              "gbps": gbps, "threads": threads, "cgroup": cgroup, "reps": args.reps,
              "parts": parts, "workdir": str(args.workdir)}
             for system, placement, parts in sc["pools"]]  # fmt: skip
    # One child per system: it stores once, then times every repetition (the pool children sit
    # between LMCache's configurations, so drift hits both).
    lmc = [{**j, "scenario": name, "salt": name, "reps": j.get("reps", args.reps),
            "cgroup": cgroup, "workdir": str(args.workdir), "threads": threads}
           for j in sc["lmcache"]]  # fmt: skip
    if extra is not None:
        pools[0]["extra"] = [extra]
        if lmc:  # LMCache O_DIRECT at that thread count
            lmc[0]["extra"] = [*lmc[0].get("extra", []), {
                "threads": extra["threads"], "scenario": extra["scenario"], "odirect": True}]
    for spec in [*lmc[:1], *pools, *lmc[1:]]:
        run_child(g, spec, args.timeout, sink)


def _per_rep(results: dict[str, list[Result]], scenario: str, combine) -> list[float]:
    """Per repetition: ``combine`` folded over the alone parts' results / the pool's fetch."""
    pool = {r.rep: r.seconds for r in results.get(f"{scenario}/pool", []) if r.seconds}
    acc: dict[int, float] = {}
    for key, rs in results.items():
        if key.startswith(f"{scenario}/alone:"):
            for r in rs:
                if r.seconds:
                    acc[r.rep] = combine(acc.get(r.rep, 0.0), r)
    return [acc[rep] / pool[rep] for rep in sorted(pool) if rep in acc]


def _fastest(results: dict[str, list[Result]], key: str, per_step: bool) -> dict[int | None, float]:
    """The fastest of a part's measurements: per step (``rep``: each step of a placement run
    holds another prefix), or over every repetition (None: the same chunks each time)."""
    best: dict[int | None, float] = {}
    for r in results.get(key, []):
        if r.seconds:
            k = r.rep if per_step else None
            best[k] = min(best.get(k, r.seconds), r.seconds)
    return best


def in_run_bounds(results: dict[str, list[Result]], scenario: str, per_step: bool = False,
                  together: bool = True) -> dict[int | None, float]:  # fmt: skip
    """The in-run bound from the minima of its parts (issue #46 item 3): max over devices of the
    device's share alone, and ``together`` (every share at once without the pool's lookup and
    planning) when that is slower, each part the fastest of its repeated measurements in the
    same run. A single sample of a part is as noisy as the pool's fetch (the pool beat such a
    bound by 4 %); the minimum of several is what the hardware can do, so the pool can only beat
    it by less than the parts' spread."""
    bound: dict[int | None, float] = {}
    parts = [k for k in results if k.startswith(f"{scenario}/alone:")]
    if together:
        parts.append(f"{scenario}/together")
    for key in parts:
        for k, t in _fastest(results, key, per_step).items():
            bound[k] = max(bound.get(k, 0.0), t)
    return bound


def bound_fracs(results: dict[str, list[Result]], scenario: str, per_step: bool = False,
                together: bool = True) -> list[float]:  # fmt: skip
    """Per repetition (or step): the in-run bound / the pool's fetch (<= 1 but for noise
    smaller than the parts' spread)."""
    bound = in_run_bounds(results, scenario, per_step, together)
    pool = {r.rep: r.seconds for r in results.get(f"{scenario}/pool", []) if r.seconds}
    return [bound[rep if per_step else None] / t for rep, t in sorted(pool.items())
            if (rep if per_step else None) in bound]


def alone_fracs(results: dict[str, list[Result]], scenario: str) -> list[float]:
    """Per repetition: max over devices of the fastest share alone / the pool's fetch."""
    return bound_fracs(results, scenario, together=False)


def cpu_floors(results: dict[str, list[Result]], scenario: str) -> list[float]:
    """Per repetition: the CPU the shares alone used (user+sys seconds, summed) over the usable
    cores / the pool's fetch. A fetch doing the same copies and hashes cannot finish sooner
    than its CPU work spread over every core, so on few cores this floor can sit above the
    max-over-devices bound (which assumes each share keeps the cores it had alone)."""
    cores = len(os.sched_getaffinity(0))
    return _per_rep(results, scenario, lambda acc, r: acc + r.cpu_s / cores)


def summarize(g: Geometry, results: dict[str, list[Result]], args: argparse.Namespace,
              log) -> str:  # fmt: skip
    log(f"\n{'scenario/system':32s} {'seconds med [min-max]':>24s} {'GB/s':>6s} "
        f"{'cpu_s/GB':>8s} identical")
    times = {k: [r.seconds for r in v if r.seconds and r.identical] for k, v in results.items()}
    for key, rs in results.items():
        ts = times[key]
        if not ts:
            log(f"{key:32s} {rs[0].note}")
            continue
        nbytes = med([r.nbytes for r in rs if r.seconds])
        log(f"{key:32s} {spread(ts):>24s} {nbytes / med(ts) / 1e9:6.2f} "
            f"{med([r.cpu_s / (r.nbytes / 1e9) for r in rs if r.seconds]):8.2f} "
            f"{all(r.identical for r in rs)}")

    def ratio(num: str, den: str) -> float:
        a, b = times.get(num, []), times.get(den, [])
        return med(a) / med(b) if a and b else float("nan")

    s1_lmc = [k for k in ("S1/lmcache-slice-odirect", "S1/lmcache-slice-buffered",
                          "S1/lmcache-kernel-odirect") if times.get(k)]  # fmt: skip
    best_lmc = min(s1_lmc, key=lambda k: med(times[k])) if s1_lmc else None
    x = ratio(best_lmc, "S1/pool") if best_lmc else float("nan")
    xv = ratio(best_lmc, "S1/pool-verify") if best_lmc else float("nan")
    sweep = sorted({k.split("/")[0] for k in results if k.startswith("S1-t")})
    fracs = {s: bound_fracs(results, s) for s in ("S1", *sweep, "S1-spdk", "S2", "S3")}
    f = med(fracs["S1"]) if fracs["S1"] else float("nan")
    w_probe = med(fracs["S3"]) if fracs["S3"] else float("nan")
    v = ratio("S1/serial", "S1/pool")
    y = ratio("S3/lmcache-slice-odirect", "S3/pool")
    pool_cpu = [r.cpu_s / (r.nbytes / 1e9) for r in results.get("S1/pool", []) if r.seconds]
    c = med(pool_cpu) if pool_cpu else float("nan")
    pool_threads = max((r.threads for r in results.get("S1/pool", [])), default=0)
    lmc_threads = max((r.threads for r in results.get(best_lmc or "", [])), default=0)
    if best_lmc:
        lmc_cpu = [r.cpu_s / (r.nbytes / 1e9) for r in results[best_lmc] if r.seconds]
        log(f"S1 on equal footing: both timed from the call (lookup included) to the last byte "
            f"in the KV cache; threads: pool {pool_threads}, LMCache {lmc_threads}; CPU-s/GB: "
            f"pool {c:.2f}, LMCache {med(lmc_cpu):.2f}")
        log(f"X uses LMCache's faster configuration in S1: {best_lmc.split('/')[1]}; against "
            f"pool-verify (host chunks hashed on every fetch too): {xv:.2f}")
    for s, fr in fracs.items():
        if fr:
            log(f"{s}: in-run bound (max of the slowest share alone and the shares together "
                "unplanned, each the fastest of its repetitions) / pool, per rep: "
                + ", ".join(f"{x_:.2f}" for x_ in fr))
            log(f"{s}: slowest share alone (fastest of its repetitions) / pool, per rep: "
                + ", ".join(f"{x_:.2f}" for x_ in alone_fracs(results, s)))
            floors = cpu_floors(results, s)
            if floors:
                log(f"{s}: CPU floor (alone parts' user+sys CPU-s / {len(os.sched_getaffinity(0))}"
                    " cores) / pool, per rep: " + ", ".join(f"{x_:.2f}" for x_ in floors))
            if max(fr) > 1.0:
                log(f"{s}: WARNING the pool beat its in-run bound in some repetition (> 1): "
                    "faster than the fastest measurement of one of the bound's parts")
    by_threads: dict[int, tuple[float, float]] = {}  # S1 per copy-thread count: (X, F)
    for sc in ("S1", *sweep):
        rs = results.get(f"{sc}/pool", [])
        if rs and times.get(f"{sc}/pool"):
            x_t = ratio(f"{sc}/lmcache-slice-odirect", f"{sc}/pool")
            by_threads[rs[0].threads] = (x_t, med(fracs[sc]) if fracs[sc] else float("nan"))
            log(f"S1 at {rs[0].threads} copy thread(s) on both sides ({sc}): pool "
                f"{med(times[f'{sc}/pool']):.3f} s, LMCache O_DIRECT / pool {x_t:.2f}, "
                f"frac_of_bound {by_threads[rs[0].threads][1]:.2f}")
    r_rr, f_multi, n_rec, r_s4 = placement_summary(results, log)
    if times.get("S1-spdk/pool") and times.get("S1/pool"):
        log(f"S1-spdk: the pool with its SSD share on SPDK / on io_uring (seconds): "
            f"{ratio('S1-spdk/pool', 'S1/pool'):.2f}; SSD share alone, SPDK / io_uring: "
            f"{ratio('S1-spdk/alone:spdk0', 'S1/alone:ssd0'):.2f}")
    for other, what in (("pool-rr", "round robin (a uniform split: equal chunks per device)"),
                        ("pool-tiered", "tiered (fill host pools, then SSDs, in config order)")):
        if times.get(f"S3/{other}") and times.get("S3/pool"):
            log(f"S3 placement gain: {what} / bandwidth = {ratio(f'S3/{other}', 'S3/pool'):.2f}")
    if args.out is not None:
        plot(results, args.out / "bench_kvpool.png", g)
    # F: the adaptive placement's, the lower of S3p and S4 (the probe's S3 when not run)
    w = f_multi if f_multi == f_multi else w_probe
    log(f"S3 (the probe's prior, one prefix): in-run bound / pool {w_probe:.2f}")
    one = by_threads.get(1, (float("nan"), float("nan")))
    many = max(by_threads, default=0)
    n_t = by_threads.get(many, (float("nan"), float("nan"))) if many > 1 else (float("nan"),) * 2
    return (f"ratio_vs_lmcache={x:.2f} frac_of_bound={f:.2f} ratio_vs_serial={v:.2f} "
            f"ratio_vs_lmcache_multi={y:.2f} multi_frac_of_bound={w:.2f} cpu_s_per_gb={c:.2f} "
            f"lmcache_threads={lmc_threads} pool_threads={pool_threads} "
            f"ratio_vs_lmcache_1t={one[0]:.2f} frac_of_bound_1t={one[1]:.2f} "
            f"ratio_vs_lmcache_nt={n_t[0]:.2f} frac_of_bound_nt={n_t[1]:.2f} n_threads={many} "
            f"ratio_vs_rr_multi={r_rr:.2f} slowdown_recovery_fetches={n_rec} "
            f"ratio_vs_rr_s4={r_s4:.2f}")


STEADY_STEPS = 3  # S3p: the last steps, where a learning placement has settled


def placement_summary(results: dict[str, list[Result]],
                      log) -> tuple[float, float, str, float]:  # fmt: skip
    """(ratio_vs_rr_multi, multi_frac_of_bound, slowdown_recovery_fetches, ratio_vs_rr_s4) of
    the placement runs: S3p's round robin / adaptive fetch (median over the last
    ``STEADY_STEPS`` steps); the adaptive placement's in-run bound / fetch, the lower of S3p
    (last steps) and S4 (all steps); in S4 the slowed fetches the adaptive pool took before a
    save gave the slowed device fewer bytes than it got before the slowdown (the issue's "a
    slowed device gets fewer new chunks within N fetches"): ``none`` if it never did while
    slowed; and S4's round robin / adaptive over the whole run (summed fetch seconds), with
    each phase (before, slowed, recovered) logged per policy."""
    nan = float("nan")

    def steps(key: str) -> list[Result]:
        return sorted((r for r in results.get(key, []) if r.seconds), key=lambda r: r.rep)

    def second(r: Result) -> int:  # bytes of the fetch the throttled second SSD served
        return r.device_bytes.get("ssd1", 0)

    for sc in ("S3p", "S4"):
        for policy, _, _ in POLICIES:
            rs = steps(f"{sc}:{policy}/pool")
            if rs:
                fr = bound_fracs(results, f"{sc}:{policy}", per_step=True)
                log(f"{sc} {policy:10s} per step: fetch s " + " ".join(f"{r.seconds:.3f}" for r in rs)
                    + " | second SSD MiB " + " ".join(f"{second(r) / 2**20:.0f}" for r in rs)
                    + " | bound/fetch " + " ".join(f"{x:.2f}" for x in fr))  # fmt: skip
    rr, ad = steps("S3p:rr/pool")[-STEADY_STEPS:], steps("S3p:adaptive/pool")[-STEADY_STEPS:]
    ratio = med([r.seconds for r in rr]) / med([r.seconds for r in ad]) if rr and ad else nan
    fr3 = bound_fracs(results, "S3p:adaptive", per_step=True)[-STEADY_STEPS:]
    fr4 = bound_fracs(results, "S4:adaptive", per_step=True)
    f = min(med(fr3) if fr3 else nan, med(fr4) if fr4 else nan) if fr3 and fr4 else nan
    s4 = steps("S4:adaptive/pool")
    recovery = "none"
    slowed = [r for r in s4 if json.loads(r.note or "{}").get("throttle_mbps", 0)
              < json.loads(s4[0].note or "{}").get("throttle_mbps", 0)] if s4 else []  # fmt: skip
    if s4 and slowed:
        before = med([second(r) for r in s4 if r.rep < slowed[0].rep])
        for n, r in enumerate(slowed):
            if second(r) < before:
                recovery = str(n)  # fetches at the slowed speed that came before this save
                break
        log(f"S4: the second SSD served {before / 2**20:.0f} MiB a fetch before the slowdown; "
            f"slowdown_recovery_fetches={recovery}")
        after = [r for r in s4 if r.rep > slowed[-1].rep]
        back = next((str(n) for n, r in enumerate(after) if second(r) >= before), "none")
        log(f"S4: fetches after the restore before the second SSD got its earlier share back: "
            f"{back}")
    return ratio, f, recovery, s4_phases(results, log)


def s4_phases(results: dict[str, list[Result]], log) -> float:
    """S4 per phase (before the slowdown, slowed, recovered): each policy's median fetch and the
    second SSD's median bytes, the in-run bound / fetch, and round robin / adaptive; returns
    round robin / adaptive over the whole run (summed fetch seconds: what a server waits)."""
    pools = {p: {r.rep: r for r in results.get(f"S4:{p}/pool", []) if r.seconds}
             for p, _, _ in POLICIES}  # fmt: skip
    if not pools["rr"] or not pools["adaptive"]:
        return float("nan")
    mbps = {rep: json.loads(r.note or "{}").get("throttle_mbps", 0)
            for rep, r in pools["rr"].items()}  # fmt: skip
    full = mbps[min(mbps)]
    slowed = [rep for rep in sorted(mbps) if mbps[rep] < full]
    phases = {"before": [rep for rep in sorted(mbps) if not slowed or rep < slowed[0]],
              "slowed": slowed,
              "recovered": [rep for rep in sorted(mbps) if slowed and rep > slowed[-1]]}
    for phase, reps in phases.items():
        if not reps:
            continue
        row = []
        for p, by_rep in pools.items():
            ts = [by_rep[rep].seconds for rep in reps if rep in by_rep]
            mib = [by_rep[rep].device_bytes.get("ssd1", 0) / 2**20 for rep in reps if rep in by_rep]
            fr = dict(zip(sorted(by_rep), bound_fracs(results, f"S4:{p}", per_step=True),
                          strict=False))  # fmt: skip
            frs = [fr[rep] for rep in reps if rep in fr]
            if ts:
                row.append(f"{p} {med(ts):.3f} s (second SSD {med(mib):.0f} MiB, bound/fetch "
                           f"{med(frs) if frs else float('nan'):.2f})")
        rr = [pools["rr"][rep].seconds for rep in reps if rep in pools["rr"]]
        ad = [pools["adaptive"][rep].seconds for rep in reps if rep in pools["adaptive"]]
        log(f"S4 {phase:9s} (steps {reps[0]}-{reps[-1]}): " + "; ".join(row)
            + f"; rr / adaptive {sum(rr) / sum(ad):.2f}")
    for phase in ("before", "recovered"):  # each phase's first request is placed before any
        # fetch of it (the prior's split; the slowed one): blind for any learner, judged apart
        later = [rep for rep in phases[phase][1:] if rep in pools["rr"] and rep in pools["adaptive"]]
        if later:
            rr = [pools["rr"][rep].seconds for rep in later]
            ad = [pools["adaptive"][rep].seconds for rep in later]
            log(f"S4 {phase}, after its first step (steps {later[0]}-{later[-1]}): rr "
                f"{med(rr):.3f} s, adaptive {med(ad):.3f} s (medians); rr / adaptive "
                f"{sum(rr) / sum(ad):.2f}")
    common = [rep for rep in pools["rr"] if rep in pools["adaptive"]]
    total = (sum(pools["rr"][rep].seconds for rep in common)
             / sum(pools["adaptive"][rep].seconds for rep in common))  # fmt: skip
    log(f"S4 whole run: rr / adaptive {total:.2f} (summed fetch seconds over {len(common)} steps)")
    return total


def plot(results: dict[str, list[Result]], path: Path, g: Geometry) -> None:
    """Per scenario: every system's fetch time (median, min-max) beside the in-run bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_scenario: dict[str, list[str]] = {}
    for key, rs in results.items():
        if (any(r.seconds for r in rs) and not key.split("/")[1].startswith("alone:")
                and ":" not in key.split("/")[0]):  # placement runs: per step, in the log  # fmt: skip
            by_scenario.setdefault(key.split("/")[0], []).append(key)
    if not by_scenario:
        return
    fig, axes = plt.subplots(1, len(by_scenario), figsize=(5.5 * len(by_scenario), 4),
                             squeeze=False)  # fmt: skip
    for ax, (scenario, keys) in zip(axes[0], sorted(by_scenario.items()), strict=True):
        ts = [[r.seconds for r in results[k] if r.seconds] for k in keys]
        mids = [med(t) for t in ts]
        err = [[m - min(t) for m, t in zip(mids, ts, strict=True)],
               [max(t) - m for m, t in zip(mids, ts, strict=True)]]  # fmt: skip
        labels = [k.split("/")[1] + ("\n(partial hit)" if any(r.note.startswith("partial")
                                                              for r in results[k]) else "")
                  for k in keys]  # fmt: skip
        ax.barh(labels, mids, xerr=err, color=["C0" if lb.startswith("pool") else "C1"
                                               if lb.startswith("lmcache") else "C2"
                                               for lb in labels])  # fmt: skip
        bound = in_run_bounds(results, scenario).get(None)
        if bound:
            ax.axvline(bound, color="k", ls="--", label="in-run bound (its parts' minima)")
            ax.legend(fontsize=7)
        ax.set_title(f"{scenario}")
        ax.set_xlabel("fetch seconds (median, min-max)")
    fig.suptitle(f"{g.tokens}-token prefix ({g.prefix_bytes / 2**30:.1f} GiB), cold")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-fraction", type=float, default=0.875, help="S1 host share (< 1)")
    p.add_argument("--small-host-fraction", type=float, default=0.5, help="S2/S3 host share")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", nargs="*", choices=("S1", "S1-spdk", "S2", "S3"), default=None)
    p.add_argument("--spdk-trid", default="",
                   help="also run S1-spdk: S1 with its SSD share on this SPDK namespace (an "
                        "NVMe/TCP target, docs/kvio-spdk.md; the module built with SPDK)")
    p.add_argument("--throttle-mbps", type=int, default=1500,
                   help="read limit of the second SSD (cgroup io.max / blkio)")  # fmt: skip
    p.add_argument("--no-lmcache", action="store_true", help="skip LMCache even if importable")
    p.add_argument("--tiered", action="store_true",
                   help="S3 also with a tiered fill (host pools, then SSDs): one more child, "
                        "~40 s, outside the default run's 10 minutes")
    p.add_argument("--lmcache-kernel", action="store_true",
                   help="also LMCache with its own (slow on CPU) copy kernel")  # fmt: skip
    p.add_argument("--no-multi", action="store_true", help="skip S3 (no second SSD device)")
    p.add_argument("--no-placement", action="store_true",
                   help="skip the placement runs (S3p: a wrong prior, S4: a device slowed)")
    p.add_argument("--placement-steps", type=int, default=5,
                   help="S3p: prefixes saved and fetched in turn per placement policy")
    p.add_argument("--s4-recovered-steps", type=int, default=5,
                   help="S4: steps after the slowed SSD's limit is restored (the first is placed "
                        "before any recovered fetch was seen, by any learning placement)")
    p.add_argument("--placement-divisor", type=int, default=4,
                   help="S3p/S4: each step's prefix is --tokens / this (4: the throttled SSD's "
                        "share spans several of blk-throttle's 100 ms slices, docs/kvpool.md)")
    p.add_argument("--no-thread-sweep", action="store_true",
                   help="skip S1 at the copy-thread count the probe did not pick")
    p.add_argument("--timeout", type=float, default=600, help="per child process, seconds")
    p.add_argument("--lmcache-timeout", type=float, default=30,
                   help="S2: how long LMCache-as-documented may take before 'did not complete'")
    p.add_argument("--workdir", type=Path, default=REPO / "out" / "bench_kvpool",
                   help="directory on the SSD for the device file and LMCache's disk tier")
    p.add_argument("--out", type=Path, default=None, help="write the plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    if "--model" in argv:  # the paper's models, per model (beside this script)
        sys.path.insert(0, str(Path(__file__).parent))
        from kvpool_models import main as models_main

        return models_main(argv)
    p = build_parser()
    args = p.parse_args(argv)
    args.geometry = Geometry(args.layers, args.kv_heads, args.head_dim, args.dtype,
                             args.block_size, args.tokens, args.chunk_tokens)  # fmt: skip
    try:
        args.geometry.check()
    except ValueError as exc:
        p.error(str(exc))
    if args.geometry.chunk_tokens != LMCACHE_CHUNK:
        p.error(f"--chunk-tokens must be {LMCACHE_CHUNK} (LMCache's chunk) for a like-for-like run")
    if not (0 < args.small_host_fraction < args.host_fraction < 1) or args.reps < 1:
        p.error("need 0 < --small-host-fraction < --host-fraction < 1 and --reps >= 1")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
