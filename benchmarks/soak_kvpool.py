"""Soak: `kvpool serve` (vLLM + the pool) under concurrent streaming clients, a failing SSD,
injected I/O errors and a restart, every greedy completion checked against a no-connector server.

    python benchmarks/soak_kvpool.py                  # full: <= 10 minutes on 2 cores
    python benchmarks/soak_kvpool.py --short          # the test-suite mode (<= 3 minutes)
    python benchmarks/soak_kvpool.py --resume         # finish a killed run's reference replay
    python benchmarks/soak_kvpool.py --report-only    # the counts of a run from its files alone

The model is the tests' tiny Llama with seeded random O(1) weights (its output depends on the
KV, unlike vLLM's dummy weights). The pool: a host pool and two O_DIRECT SSD files. vLLM's own
prefix cache is off on both servers, so every reused prefix goes through the pool. N client
threads stream completions over 127.0.0.1 for a bounded time, mixing shared long prefixes,
multi-turn chats (each turn extends the previous prompt with its answer) and unique prompts.
Phases (each request records the one it completed in):

* ``before``: all devices healthy;
* ``ssd1-failed``: ``ssd1``'s file is renamed away and truncated (reads past its end fail and
  the engine marks it failed; a save re-extends the file, so a read below the new end finds
  zeros and the chunk is counted corrupt; either way its chunks become misses);
* ``ssd1-restored``: a new empty file of the old size takes the path (the engine reopens and
  checks it and places chunks there again; what it wrote into the lost file stays lost);
* ``after-restart``: the server is drained, stopped and started again on the same files (chunks
  on the SSDs are found again through their index records; host-memory chunks are lost). Where
  the C++ module is built with fault injection (``_kvio.fault_injection()``), this lifetime runs
  with ``KVPOOL_FAULTS`` making ``ssd1`` fail a few reads and writes with EIO.

Afterwards a server without the connector answers every distinct prompt that was sent.

Everything is written to ``--workdir`` as it happens, one JSON object a line, flushed per line:
``requests.jsonl`` (each request's prompt and streamed tokens, TTFT, error, phase, server
lifetime), ``reference.jsonl`` (the reference answers, keyed by a hash of the prompt),
``statuses.jsonl`` (the pool's status at the end of each server lifetime), ``samples.jsonl``
(the server processes' RSS each second) and ``events.jsonl``. A killed run therefore still has
its counts (``--report-only``), and ``--resume`` replays only the prompts the reference has not
answered yet.

Last line: ``requests=N errors=E mismatches=M restart_hits=K io_errors_injected=I wrong_bytes=W
rss_growth_mib=G``:

* ``errors``: requests that failed (HTTP error, broken stream);
* ``mismatches``: requests whose streamed completion differs from the reference's;
* ``restart_hits``: chunk loads the restarted server served from chunks restored off the SSDs;
* ``io_errors_injected``: ``ssd1``'s device errors as the engine counted them (status file,
  ``transfers.devices.ssd1.errors``) in the lifetime that ran with ``KVPOOL_FAULTS``; 0 with a
  note where the module has no fault injection;
* ``wrong_bytes``: after the last server stopped, every intact index record on the SSD files is
  read back with its chunk's data: bytes of chunks whose data does not hash to the checksum the
  record was written with (a record is written only after its data was durable, so a restart
  would take such a chunk as valid);
* ``rss_growth_mib``: the server processes' resident memory growth within a lifetime (last sample
  minus the sample after the lifetime's first fifth), the largest over the lifetimes.

Every server is stopped by its pid (and its engine-core children by theirs), also on SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from support.model import TINY, write_tiny_llama  # noqa: E402
from support.serving import BLOCK_SIZE, Server, become_subreaper, reap_orphans  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 3, 500
MAX_MODEL_LEN = 2048
MAX_TOKENS = 8
REPLAY_THREADS = 4  # the reference batches them (--max-num-seqs 8)
FAULT_DEVICE = "ssd1"
# After the restart: skip a few of ssd1's reads and writes (restored chunks are served first),
# then fail the next ones with EIO.
FAULT_RULES = (f"device={FAULT_DEVICE},op=read,errno=EIO,after=4,count=3;"
               f"device={FAULT_DEVICE},op=write,errno=EIO,after=8,count=3")  # fmt: skip
PHASES = ("before", "ssd1-failed", "ssd1-restored", "after-restart")


# ----------------------------------------------------------------------------- servers
SERVE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
               "--no-enable-prefix-caching", "--served-model-name", "m",
               "--kv-cache-memory-bytes", str(256 << 20)]  # fmt: skip
# Both servers' environment. vLLM's CPU worker keeps one oneDNN primitive per new GEMM shape
# (1024 by default): under varied prompt lengths a server without the connector grew ~660 MiB in
# 120 s, and stayed flat after its first 10 s with the cache off. CUDA servers have no such
# cache; off, the growth the soak reports is the pool's and vLLM's own, not oneDNN's.
SERVER_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


def pool_config(work: Path) -> dict[str, Any]:
    return {"chunk_tokens": 64, "device_retry_seconds": 2,
            "devices": [  # SSDs first and heavier: a prefix starts on them and survives restarts
                {"ssd": {"path": str(work / "ssd0.kvpool"), "capacity": "48MiB",
                         "bandwidth_gbps": 2.0}},
                {"ssd": {"path": str(work / "ssd1.kvpool"), "capacity": "48MiB",
                         "bandwidth_gbps": 2.0}},
                {"host": {"capacity": "16MiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip


def fault_injection() -> bool:
    """Whether the C++ module honours ``KVPOOL_FAULTS`` (built with fault injection)."""
    from vllm_kvpool import _kvio

    probe = getattr(_kvio, "fault_injection", None)
    return bool(probe()) if probe is not None else False


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


# ----------------------------------------------------------------------------- journal
class Journal:
    """The run's files in the work directory, one JSON object a line, appended and flushed as
    things happen (a killed run keeps everything it saw)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.lock = threading.Lock()
        self.files: dict[str, Any] = {}

    def append(self, name: str, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self.lock:
            f = self.files.get(name)
            if f is None:
                f = self.files[name] = open(self.work / f"{name}.jsonl", "a")  # noqa: SIM115
            f.write(line)
            f.flush()

    def read(self, name: str) -> list[dict[str, Any]]:
        """Every complete line (a line cut by a kill is dropped)."""
        path = self.work / f"{name}.jsonl"
        out = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def close(self) -> None:
        with self.lock:
            for f in self.files.values():
                f.close()
            self.files.clear()


def prompt_key(prompt: list[int]) -> str:
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- requests
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
    journal: Journal
    lock: threading.Lock = field(default_factory=threading.Lock)
    open_gate: threading.Event = field(default_factory=threading.Event)  # cleared: drain
    inflight: int = 0
    stop_at: float = 0.0
    phase: str = PHASES[0]
    lifetime: int = 0

    def record(self, kind: str, prompt: list[int], completion: list[int], ttft: float,
               error: str = "") -> None:  # fmt: skip
        self.journal.append("requests", {
            "phase": self.phase, "server": "pool", "lifetime": self.lifetime, "kind": kind,
            "prompt": prompt, "completion": completion, "ttft": ttft, "error": error})  # fmt: skip


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
                run.record(kind, prompt, ids, ttft)
                prompt = prompt + ids
            except Exception as exc:  # noqa: BLE001 - counted, reported, the soak goes on
                run.record(kind, prompt, [], 0.0, f"{type(exc).__name__}: {exc}")
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


# ----------------------------------------------------------------------------- the load
def load(run: Run, pooled: Server, seconds: float, clients: int, startup_timeout: float,
         faults: str, log: Callable[[str], None]) -> None:  # fmt: skip
    """The clients' load through the four phases (ssd1 failed and restored, the restart)."""
    journal, work = run.journal, pooled.log.parent

    def event(text: str, **extra: Any) -> None:
        journal.append("events", {"t": round(time.monotonic() - start, 1), "wall": time.time(),
                                  "event": text, **extra})  # fmt: skip
        log(f"  {time.monotonic() - start:5.0f} s  {text}")

    base = Workload(0, [])
    prefixes = [base.tokens(900) for _ in range(3)]
    run.open_gate.set()
    run.stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(run, pooled, Workload(100 + i, prefixes)),
                                daemon=True) for i in range(clients)]  # fmt: skip
    start = time.monotonic()
    for t in threads:
        t.start()
    event(f"load started: {clients} clients, {seconds:.0f} s", phase=run.phase)
    fault_at, restore_at, restart_at = (start + seconds * f for f in (0.2, 0.35, 0.55))
    step = "fault"
    ssd1 = work / "ssd1.kvpool"
    away = work / "ssd1.detached"
    size = 0
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        journal.append("samples", {"t": round(now - start, 2), "mib": rss_mib(pooled.pids()),
                                   "life": run.lifetime})  # fmt: skip
        if step == "fault" and now >= fault_at:
            # The SSD goes away: its path is gone (reopening fails) and the open file loses
            # its data (reads end early: the engine marks the device failed).
            size = ssd1.stat().st_size
            os.rename(ssd1, away)
            os.truncate(away, 0)
            run.phase = "ssd1-failed"
            event("ssd1 detached (path gone, data lost)", phase=run.phase)
            step = "restore"
        elif step == "restore" and now >= restore_at:
            failed = [u["name"] for u in pooled.status().get("usage", []) if u["failed"]]
            # Back, empty: a new file (the engine reopens and checks it). Not the lost one
            # again: a save whose data landed before the truncation and its index record after
            # it left a record over zeros there, which the byte check would charge to the pool.
            # The lost file goes with whatever the engine wrote into it meanwhile.
            with open(ssd1, "xb") as f:
                f.truncate(size)
            os.unlink(away)
            run.phase = "ssd1-restored"
            event(f"ssd1 reattached (failed before: {failed})", phase=run.phase)
            step = "recovered"
        elif step == "recovered" and now >= restore_at + 5:
            failed = [u["name"] for u in pooled.status().get("usage", []) if u["failed"]]
            event(f"failed devices now: {failed}")
            step = "restart"
        elif step == "restart" and now >= restart_at:
            drain(run)
            journal.append("statuses", {"life": run.lifetime, "status": fresh_status(pooled)})
            pooled.stop()
            event("pool server stopped (drained)")
            run.lifetime += 1
            run.phase = "after-restart"
            if faults:
                pooled.env["KVPOOL_FAULTS"] = faults
            event("pool server starting" + (f" with KVPOOL_FAULTS={faults}" if faults else ""),
                  life=run.lifetime, faults=faults)  # fmt: skip
            pooled.start()
            pooled.wait_ready(startup_timeout)
            event(f"pool server up again (pid {pooled.proc.pid})", phase=run.phase)
            run.stop_at += time.monotonic() - now  # the restart does not eat load time
            run.open_gate.set()
            step = "done"
        time.sleep(1.0)
    journal.append("statuses", {"life": run.lifetime, "status": fresh_status(pooled)})
    pooled.stop()
    n = len(journal.read("requests"))
    event(f"load done: {n} requests", load_done=True)


def replay(journal: Journal, reference: Server, log: Callable[[str], None]) -> None:
    """Ask the no-connector server every distinct prompt that got an answer and that it has not
    answered yet (a resumed run skips those in ``reference.jsonl``)."""
    done = {a["key"] for a in journal.read("reference")}
    todo: dict[str, list[int]] = {}
    for r in journal.read("requests"):
        key = prompt_key(r["prompt"])
        if not r["error"] and key not in done:
            todo.setdefault(key, r["prompt"])
    items = list(todo.items())
    log(f"replaying {len(items)} prompts on the reference server ({len(done)} answered before)")
    start = time.monotonic()
    failures: list[BaseException] = []

    def worker(part: list[tuple[str, list[int]]]) -> None:
        try:
            for key, prompt in part:
                ids, _ = complete(reference.port, prompt, stream=False)
                journal.append("reference", {"key": key, "completion": ids})
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(items[i::REPLAY_THREADS],), daemon=True)
               for i in range(REPLAY_THREADS)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    log(f"replay done in {time.monotonic() - start:.0f} s")


# ----------------------------------------------------------------------------- the check
def wrong_ssd_bytes(pool: dict[str, Any]) -> tuple[int, int]:
    """(chunks checked, bytes of chunks whose data disagrees with its index record): every
    intact record on the SSD files, its slot's data read back and hashed (no server running)."""
    from vllm_kvpool import _kvio
    from vllm_kvpool.config import parse_pool_config
    from vllm_kvpool.handlers.device import DeviceHandler
    from vllm_kvpool.layout import ChunkLayout
    from vllm_kvpool.persist import record_bytes, scan_records

    config = parse_pool_config(pool)
    bpc = config.chunk_tokens // BLOCK_SIZE
    layout = ChunkLayout.uniform(TINY.kv_bytes_per_token() * BLOCK_SIZE, bpc)
    checked = wrong = 0
    for cfg in config.devices:
        if cfg.kind != "ssd":
            continue
        path = str(cfg.settings.path)
        data, _, _ = DeviceHandler.regions(cfg, layout)
        records = scan_records(path, data, layout.num_slots(cfg), record_bytes(bpc))
        if not records:  # a missing file (ssd1 detached when the run was killed) has none
            continue
        with open(path, "rb") as f:
            for rec in records:
                if rec.slot_bytes != layout.slot_bytes:
                    raise RuntimeError(f"{cfg.name}: record slot_bytes {rec.slot_bytes}, the "
                                       f"tiny model's chunks take {layout.slot_bytes}")  # fmt: skip
                f.seek(rec.slot * rec.slot_bytes)
                raw = f.read(-(-rec.nbytes // 4096) * 4096)  # the O_DIRECT length written
                checked += 1
                if _kvio.checksum(raw) != rec.checksum:
                    wrong += rec.nbytes
    return checked, wrong


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def lifetime_statuses(journal: Journal) -> dict[int, dict[str, Any]]:
    """The pool's last status of each server lifetime: the snapshot taken at its end, else
    (a killed run) the status file if the lifetime's server wrote it."""
    by_life = {s["life"]: s["status"] for s in journal.read("statuses")}
    lives = {s["life"] for s in journal.read("samples")} | set(by_life)
    started = {e["life"]: e["wall"] for e in journal.read("events") if "life" in e}
    for life in lives - set(by_life):
        path = journal.work / "status.json"
        status = json.loads(path.read_text()) if path.exists() else {}
        if status and status.get("timestamp", 0) >= started.get(life, 0):
            by_life[life] = status
    return dict(sorted(by_life.items()))


def report(journal: Journal, out: Path, log: Callable[[str], None]) -> int:
    """Counts, the mismatch check and the byte check, from the work directory's files alone."""
    meta = json.loads((journal.work / "run.json").read_text())
    results = journal.read("requests")
    answers = {a["key"]: a["completion"] for a in journal.read("reference")}
    events = journal.read("events")
    by_life = lifetime_statuses(journal)
    statuses = list(by_life.values())
    samples = journal.read("samples")
    errors = [r for r in results if r["error"]]
    answered = [r for r in results if not r["error"]]
    checked = [r for r in answered if prompt_key(r["prompt"]) in answers]
    mismatched = [r for r in checked if answers[prompt_key(r["prompt"])] != r["completion"]]
    unchecked = len(answered) - len(checked)
    for r in errors[:5]:
        log(f"  error ({r['kind']}, {r['phase']}): {r['error']}")
    for r in mismatched[:5]:
        log(f"  mismatch ({r['kind']}, {r['phase']}): {len(r['prompt'])} prompt tokens")
    by_phase = {p: sum(r["phase"] == p for r in results) for p in PHASES}
    kinds = {k: sum(r["kind"] == k for r in results) for k in ("shared", "chat", "unique")}
    log(f"requests by phase: {by_phase}; by kind: {kinds}")
    if unchecked:
        log(f"NOT CHECKED: {unchecked} of {len(answered)} answered requests have no reference "
            "answer yet (run killed before or during the replay: --resume finishes it)")
    if not any(e.get("load_done") for e in events):
        log("NOTE: the load did not finish (run killed): counts cover what it recorded")
    ttft = [r["ttft"] for r in answered]
    query = sum(s.get("lookups", {}).get("query_tokens", 0) for s in statuses)
    hits = sum(s.get("lookups", {}).get("hit_tokens", 0) for s in statuses)
    last = by_life[max(by_life)].get("lookups", {}) if len(by_life) > 1 else {}
    restart_hits, restored = last.get("restored_hits", 0), last.get("restored", 0)
    devices: dict[str, dict[str, float]] = {}
    for s in statuses:
        for name, c in s.get("transfers", {}).get("devices", {}).items():
            d = devices.setdefault(name, {"read": 0, "written": 0, "errors": 0, "corrupt": 0})
            d["read"] += c["bytes_read"]
            d["written"] += c["bytes_written"]
            d["errors"] += c["errors"]
            d["corrupt"] += c["corrupt"]
    # errors the engine counted on the faulty device in the lifetime that ran with the faults
    fault_lives = {e["life"] for e in events if e.get("faults")}
    injected = sum(s.get("transfers", {}).get("devices", {}).get(FAULT_DEVICE, {})
                   .get("errors", 0) for life, s in by_life.items() if life in fault_lives)
    if not meta["config"]["faults"]:
        log("NOTE: io_errors_injected=0: the C++ module has no fault injection "
            "(_kvio.fault_injection() absent or False), that phase did not run")
    elif not fault_lives:
        log("NOTE: io_errors_injected=0: the run ended before its server ran with KVPOOL_FAULTS")
    growth = 0.0  # per lifetime: last sample minus the sample after its first fifth
    rss = [(s["t"], s["mib"], s["life"]) for s in samples]
    for life in sorted({x[2] for x in rss}):
        mib = [m for _, m, li in rss if li == life and m > 0]
        if len(mib) >= 5:
            growth = max(growth, mib[-1] - mib[len(mib) // 5])
    chunks, wrong_bytes = wrong_ssd_bytes(meta["pool"])
    log(f"hit rate {hits / query if query else 0:.1%} of {query} prompt tokens; TTFT p50 "
        f"{1e3 * statistics.median(ttft) if ttft else float('nan'):.0f} ms, p99 "
        f"{1e3 * percentile(ttft, 0.99):.0f} ms")
    for name, d in devices.items():
        log(f"  {name}: read {d['read'] / 2**20:.1f} MiB, written {d['written'] / 2**20:.1f} MiB,"
            f" errors {d['errors']:.0f}, corrupt {d['corrupt']:.0f}")
    log(f"restart: {restored} SSD chunks restored, {restart_hits} chunk loads served from them")
    log(f"byte check: {chunks} SSD chunks with an index record read back, {wrong_bytes} bytes "
        "differ from their records")
    if rss:
        log(f"server RSS: {min((m for _, m, _ in rss if m > 0), default=0):.0f}-"
            f"{max(m for _, m, _ in rss):.0f} MiB over {len(rss)} samples; growth within a "
            f"lifetime {growth:.1f} MiB")  # fmt: skip
    summary = {"requests": len(results), "errors": len(errors), "mismatches": len(mismatched),
               "unchecked": unchecked, "requests_by_phase": by_phase,
               "restart_hits": restart_hits, "restored": restored,
               "io_errors_injected": injected, "wrong_bytes": wrong_bytes,
               "chunks_checked": chunks, "hit_rate": hits / max(query, 1),
               "ttft_p50_s": statistics.median(ttft) if ttft else None,
               "ttft_p99_s": percentile(ttft, 0.99), "devices": devices,
               "rss_mib": rss, "rss_growth_mib": growth}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak_kvpool.json").write_text(json.dumps(summary, indent=1))
    if rss:
        plot_rss(rss, out / "soak_kvpool_rss.png")
    log(f"requests={len(results)} errors={len(errors)} mismatches={len(mismatched)} "
        f"restart_hits={restart_hits} io_errors_injected={injected} wrong_bytes={wrong_bytes} "
        f"rss_growth_mib={growth:.1f}")
    ok = not errors and not mismatched and not unchecked and not wrong_bytes and restart_hits > 0
    return 0 if ok and (injected > 0 or not meta["config"]["faults"]) else 1


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


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="test-suite mode (<= 3 minutes)")
    p.add_argument("--seconds", type=float, default=None, help="load time (default 180; short 16)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (4; short 2)")
    p.add_argument("--workdir", type=Path, default=Path("out/soak_kvpool"))
    p.add_argument("--out", type=Path, default=Path("out"), help="RSS plot and JSON summary")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--resume", action="store_true",
                   help="finish the reference replay of the run in --workdir (its load done)")
    p.add_argument("--report-only", action="store_true",
                   help="print the counts and checks of the run in --workdir from its files")
    args = p.parse_args(argv)
    log: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    work = args.workdir.resolve()
    journal = Journal(work)
    t0 = time.monotonic()
    # SIGTERM ends the run through the finally blocks below: servers stopped, files complete
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    become_subreaper()  # the servers' engine cores' CPU counts as this run's under quiet-run
    if args.resume or args.report_only:
        meta = json.loads((work / "run.json").read_text())
        log(f"run {meta['run_id']} in {work}: {meta['config']}")
        if args.report_only:
            return report(journal, args.out, log)
        if not any(e.get("load_done") for e in journal.read("events")):
            log("its load did not finish: a load cannot be resumed (--report-only gives its "
                "counts); start a new run")  # fmt: skip
            return 2
        model = write_tiny_llama(work / "model")  # the same seeded bytes as the run's
        reference = Server("reference server", model, work / "reference.log", SERVE_FLAGS,
                           env=SERVER_ENV)  # fmt: skip
        try:
            reference.start()
            reference.wait_ready(args.startup_timeout)
            log(f"reference server up after {time.monotonic() - t0:.0f} s")
            replay(journal, reference, log)
        finally:
            reference.stop()
            reap_orphans()
            journal.close()
        return report(journal, args.out, log)

    seconds = args.seconds or (16.0 if args.short else 180.0)
    clients = args.clients or (2 if args.short else 4)
    faults = FAULT_RULES if fault_injection() else ""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pool = pool_config(work)
    config = {"seconds": seconds, "clients": clients, "faults": faults}
    (work / "run.json").write_text(json.dumps({"run_id": uuid.uuid4().hex, "config": config,
                                               "pool": pool}, indent=1))  # fmt: skip
    model = write_tiny_llama(work / "model")
    pooled = Server("pool server", model, work / "pool.log", SERVE_FLAGS, pool=pool,
                    status_file=work / "status.json", env=dict(SERVER_ENV))  # fmt: skip
    reference = Server("reference server", model, work / "reference.log", SERVE_FLAGS, env=SERVER_ENV)
    run = Run(journal)
    try:
        pooled.start()
        reference.start()  # idles until the replay; starting now overlaps the start-ups
        pooled.wait_ready(args.startup_timeout)
        log(f"[{time.monotonic() - t0:4.0f} s] pool server up (pid {pooled.proc.pid}); load:")
        load(run, pooled, seconds, clients, args.startup_timeout, faults, log)
        log(f"[{time.monotonic() - t0:4.0f} s] load done")
        reference.wait_ready(args.startup_timeout)
        replay(journal, reference, log)
        log(f"[{time.monotonic() - t0:4.0f} s] replay done")
    finally:
        run.stop_at = 0
        run.open_gate.set()
        pooled.stop()
        reference.stop()
        reap_orphans()
        journal.close()
    return report(journal, args.out, log)


if __name__ == "__main__":
    sys.exit(main())
