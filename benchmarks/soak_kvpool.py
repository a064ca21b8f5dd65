"""Soak: `kvpool serve` (vLLM + the pool) under concurrent streaming clients, a failing SSD
and a restart, every greedy completion checked against a no-connector server.

    python benchmarks/soak_kvpool.py                 # full: >= 5 minutes of load
    python benchmarks/soak_kvpool.py --short         # the test-suite mode (~2 minutes)

The model is the tests' tiny Llama with seeded random O(1) weights (its output depends on the
KV, unlike vLLM's dummy weights). The pool: a host pool and two O_DIRECT SSD files. vLLM's own
prefix cache is off on both servers, so every reused prefix goes through the pool. N client
threads stream completions over 127.0.0.1 for a bounded time, mixing shared long prefixes,
multi-turn chats (each turn extends the previous prompt with its answer) and unique prompts.
Mid-run SSD ``ssd1`` fails (its file is truncated: reads end early, the engine marks it failed,
its chunks become misses) and is restored (the file grows back; the engine reopens and checks
it and places chunks there again). Later the server is drained, stopped and started again on
the same files: chunks on the SSDs are found again through their index records (host-memory
chunks are lost). Afterwards a server without the connector answers every prompt that was sent.
Records hit rate, TTFT p50/p99, errors, resident memory of the server processes over time and
per-device bytes. Last line: ``requests=N errors=E mismatches=M restart_hits=K rss_growth_mib=G``.
Every server is stopped by its pid (and its engine-core children by theirs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from support.model import write_tiny_llama  # noqa: E402
from support.serving import Server  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 3, 500
MAX_MODEL_LEN = 2048
MAX_TOKENS = 8


# ----------------------------------------------------------------------------- servers
SERVE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
               "--no-enable-prefix-caching", "--served-model-name", "m",
               "--kv-cache-memory-bytes", str(256 << 20)]  # fmt: skip
QUIET = {"VLLM_LOGGING_LEVEL": "WARNING"}


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def fresh_status(server: Server) -> dict[str, Any]:
    """The pool's status file after one more engine step (the scheduler rewrites the file at
    most once a second, from a step)."""
    time.sleep(1.1)
    complete(server.port, [5, 6, 7, 8], stream=False)
    return server.status()


# ----------------------------------------------------------------------------- requests
@dataclass
class Result:
    prompt: list[int]
    completion: list[int]
    ttft: float
    kind: str
    error: str = ""


def complete(port: int, prompt: list[int], stream: bool, timeout: float = 300) -> tuple[list[int], float]:
    """Greedy completion of a token-id prompt: (completion ids, seconds to the first token)."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "stream": stream,
                       "return_token_ids": True})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    if not stream:
        return list(json.loads(resp.read())["choices"][0]["token_ids"]), 0.0
    ids: list[int] = []
    ttft = 0.0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        delta = json.loads(line[5:])["choices"][0].get("token_ids") or []
        if delta and not ids:
            ttft = time.perf_counter() - start
        ids += delta
    conn.close()
    return ids, ttft


@dataclass
class Workload:
    """Seeded prompts: shared long prefixes, multi-turn chats, unique prompts."""

    seed: int
    prefixes: list[list[int]]
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    def next_session(self) -> tuple[str, list[list[int]]]:
        """(kind, user turns); a chat's later turns are appended to the previous answer."""
        kind = self.rng.choices(["shared", "chat", "unique"], weights=[5, 3, 2])[0]
        if kind == "shared":
            return kind, [self.rng.choice(self.prefixes) + self.tokens(self.rng.randrange(8, 40))]
        if kind == "chat":
            return kind, [self.tokens(300)] + [self.tokens(40) for _ in range(2)]
        return kind, [self.tokens(self.rng.randrange(200, 600))]


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    open_gate: threading.Event = field(default_factory=threading.Event)  # cleared: drain
    inflight: int = 0
    stop_at: float = 0.0

    def record(self, r: Result) -> None:
        with self.lock:
            self.results.append(r)


def client(run: Run, server: Server, workload: Workload) -> None:
    while time.monotonic() < run.stop_at:
        kind, turns = workload.next_session()
        prompt: list[int] = []
        for turn in turns:
            while True:  # wait for an open gate, then count in flight atomically with it
                run.open_gate.wait()
                with run.lock:
                    if run.open_gate.is_set():
                        run.inflight += 1
                        break
            if time.monotonic() >= run.stop_at:
                with run.lock:
                    run.inflight -= 1
                return
            prompt = prompt + turn
            try:
                ids, ttft = complete(server.port, prompt, stream=True)
                run.record(Result(prompt, ids, ttft, kind))
                prompt = prompt + ids
            except Exception as exc:  # noqa: BLE001 - counted, reported, the soak goes on
                run.record(Result(prompt, [], 0.0, kind, f"{type(exc).__name__}: {exc}"))
                break
            finally:
                with run.lock:
                    run.inflight -= 1


def drain(run: Run, timeout: float = 300) -> None:
    with run.lock:
        run.open_gate.clear()
    deadline = time.monotonic() + timeout
    while run.inflight and time.monotonic() < deadline:
        time.sleep(0.1)


# ----------------------------------------------------------------------------- soak
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="test-suite mode (~2 minutes)")
    p.add_argument("--seconds", type=float, default=None, help="load time (default 330; short 24)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (4; short 2)")
    p.add_argument("--workdir", type=Path, default=Path("out/soak_kvpool"))
    p.add_argument("--out", type=Path, default=Path("out"), help="RSS plot and JSON summary")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args(argv)
    seconds = args.seconds or (24.0 if args.short else 330.0)
    clients = args.clients or (2 if args.short else 4)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(work / "model")
    pool = {"chunk_tokens": 64, "device_retry_seconds": 2,
            "devices": [  # SSDs first and heavier: a prefix starts on them and survives restarts
                {"ssd": {"path": str(work / "ssd0.kvpool"), "capacity": "48MiB",
                         "bandwidth_gbps": 2.0}},
                {"ssd": {"path": str(work / "ssd1.kvpool"), "capacity": "48MiB",
                         "bandwidth_gbps": 2.0}},
                {"host": {"capacity": "16MiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip
    pooled = Server("pool server", model, work / "pool.log", SERVE_FLAGS, pool=pool,
                    status_file=work / "status.json", env=QUIET)  # fmt: skip
    reference = Server("reference server", model, work / "reference.log", SERVE_FLAGS, env=QUIET)
    log = print
    rss: list[tuple[float, float, int]] = []  # (t, MiB, server lifetime)
    statuses: list[dict] = []
    run = Run()
    events: list[str] = []
    t0 = time.monotonic()
    try:
        pooled.start()
        reference.start()  # idles until the replay; starting now overlaps the start-ups
        pooled.wait_ready(args.startup_timeout)
        log(f"pool server up after {time.monotonic() - t0:.0f} s (pid {pooled.proc.pid})")
        base = Workload(0, [])
        prefixes = [base.tokens(900) for _ in range(3)]
        run.open_gate.set()
        run.stop_at = time.monotonic() + seconds
        threads = [threading.Thread(target=client, args=(run, pooled, Workload(100 + i, prefixes)),
                                    daemon=True) for i in range(clients)]  # fmt: skip
        start = time.monotonic()
        for t in threads:
            t.start()
        lifetime = 0
        fault_at, restore_at, restart_at = (start + seconds * f for f in (0.2, 0.35, 0.55))
        phase = "fault"
        ssd1 = work / "ssd1.kvpool"
        away = work / "ssd1.detached"
        size = 0
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            rss.append((now - start, rss_mib(pooled.pids()), lifetime))
            if phase == "fault" and now >= fault_at:
                # The SSD goes away: its path is gone (reopening fails) and the open file
                # loses its data (reads end early: the engine marks the device failed).
                size = ssd1.stat().st_size
                os.rename(ssd1, away)
                os.truncate(away, 0)
                events.append(f"{now - start:.0f}s ssd1 detached (path gone, data lost)")
                phase = "restore"
            elif phase == "restore" and now >= restore_at:
                failed = [u["name"] for u in pooled.status().get("usage", []) if u["failed"]]
                os.truncate(away, size)  # back, empty: the engine reopens and checks it
                os.rename(away, ssd1)
                events.append(f"{now - start:.0f}s ssd1 reattached (failed before: {failed})")
                phase = "recovered"
            elif phase == "recovered" and now >= restore_at + 5:
                failed = [u["name"] for u in pooled.status().get("usage", []) if u["failed"]]
                events.append(f"{now - start:.0f}s failed devices now: {failed}")
                phase = "restart"
            elif phase == "restart" and now >= restart_at:
                drain(run)
                statuses.append(fresh_status(pooled))
                pooled.stop()
                events.append(f"{time.monotonic() - start:.0f}s pool server stopped (drained)")
                pooled.start()
                pooled.wait_ready(args.startup_timeout)
                lifetime += 1
                events.append(f"{time.monotonic() - start:.0f}s pool server up again (pid "
                              f"{pooled.proc.pid})")  # fmt: skip
                run.stop_at += time.monotonic() - now  # the restart does not eat load time
                run.open_gate.set()
                phase = "done"
            time.sleep(1.0)
        statuses.append(fresh_status(pooled))
        pooled.stop()
        for e in events:
            log("  " + e)
        results = run.results
        log(f"load done: {len(results)} requests in {time.monotonic() - start:.0f} s; "
            f"replaying them on the reference server")
        reference.wait_ready(args.startup_timeout)
        mismatches = replay(results, reference)
    finally:
        run.stop_at = 0
        run.open_gate.set()
        pooled.stop()
        reference.stop()
    return report(results, mismatches, statuses, rss, args.out, seconds, clients, log)


def replay(results: list[Result], reference: Server) -> int:
    """Ask the no-connector server every prompt that got an answer; count different answers."""
    todo = [r for r in results if not r.error]
    answers: dict[tuple[int, ...], list[int]] = {}
    lock = threading.Lock()

    def worker(items: list[Result]) -> None:
        for r in items:
            key = tuple(r.prompt)
            with lock:
                if key in answers:
                    continue
            ids, _ = complete(reference.port, r.prompt, stream=False)
            with lock:
                answers[key] = ids

    threads = [threading.Thread(target=worker, args=(todo[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(answers[tuple(r.prompt)] != r.completion for r in todo)


def report(results: list[Result], mismatches: int, statuses: list[dict],
           rss: list[tuple[float, float, int]], out: Path, seconds: float, clients: int,
           log) -> int:  # fmt: skip
    errors = [r for r in results if r.error]
    for r in errors[:5]:
        log(f"  error ({r.kind}): {r.error}")
    ttft = [r.ttft for r in results if not r.error]
    query = sum(s.get("lookups", {}).get("query_tokens", 0) for s in statuses)
    hits = sum(s.get("lookups", {}).get("hit_tokens", 0) for s in statuses)
    restart_hits = statuses[-1].get("lookups", {}).get("restored_hits", 0) if len(statuses) > 1 else 0
    restored = statuses[-1].get("lookups", {}).get("restored", 0) if len(statuses) > 1 else 0
    devices: dict[str, dict[str, float]] = {}
    for s in statuses:
        for name, c in s.get("transfers", {}).get("devices", {}).items():
            d = devices.setdefault(name, {"read": 0, "written": 0, "errors": 0, "corrupt": 0})
            d["read"] += c["bytes_read"]
            d["written"] += c["bytes_written"]
            d["errors"] += c["errors"]
            d["corrupt"] += c["corrupt"]
    # memory growth per server lifetime: last sample minus the sample after its first fifth
    growth = 0.0
    for life in sorted({x[2] for x in rss}):
        samples = [m for _, m, li in rss if li == life and m > 0]
        if len(samples) >= 5:
            growth = max(growth, samples[-1] - samples[len(samples) // 5])
    kinds = {k: sum(r.kind == k for r in results) for k in ("shared", "chat", "unique")}
    log(f"clients={clients} load_seconds={seconds:.0f} requests by kind: {kinds}")
    log(f"hit rate {hits / query if query else 0:.1%} of {query} prompt tokens; TTFT p50 "
        f"{1e3 * statistics.median(ttft) if ttft else float('nan'):.0f} ms, p99 "
        f"{1e3 * percentile(ttft, 0.99):.0f} ms")
    for name, d in devices.items():
        log(f"  {name}: read {d['read'] / 2**20:.1f} MiB, written {d['written'] / 2**20:.1f} MiB,"
            f" errors {d['errors']:.0f}, corrupt {d['corrupt']:.0f}")
    log(f"restart: {restored} SSD chunks restored, {restart_hits} chunk loads served from them")
    log(f"server RSS: {min(m for _, m, _ in rss if m > 0):.0f}-{max(m for _, m, _ in rss):.0f} MiB "
        f"over {len(rss)} samples; growth within a lifetime {growth:.1f} MiB")
    summary = {"requests": len(results), "errors": len(errors), "mismatches": mismatches,
               "restart_hits": restart_hits, "restored": restored, "hit_rate": hits / max(query, 1),
               "ttft_p50_s": statistics.median(ttft) if ttft else None,
               "ttft_p99_s": percentile(ttft, 0.99), "devices": devices,
               "rss_mib": rss, "rss_growth_mib": growth}  # fmt: skip
    (out / "soak_kvpool.json").write_text(json.dumps(summary, indent=1))
    plot_rss(rss, out / "soak_kvpool_rss.png")
    log(f"requests={len(results)} errors={len(errors)} mismatches={mismatches} "
        f"restart_hits={restart_hits} rss_growth_mib={growth:.1f}")
    return 0 if not errors and not mismatches and restart_hits > 0 else 1


def plot_rss(rss: list[tuple[float, float, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for life in sorted({x[2] for x in rss}):
        pts = [(t, m) for t, m, li in rss if li == life and m > 0]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=f"server lifetime {life + 1}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS MiB (server + engine core)")
    ax.set_title("kvpool soak: resident memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
