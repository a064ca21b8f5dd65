"""One pool service per node (``kvpool daemon``) shared by engines, against each engine's own
in-process pool, with engines as real processes (``support/kvpool_node.py``: a ``LocalPool`` over
the service, i.e. the ``RemotePool`` and shared host pools a vLLM engine uses).

  trace   one shared-prefix trace (P system prompts, each request = one of them + its own
          tail; fetch the longest stored prefix, then save the request), same pool capacity:
          one engine with its own pool (``single_engine_hit_rate``) vs two engines over the
          daemon, requests alternating (``shared_hit_rate``: the second engine's hits come
          from the first's chunks); every fetched block checked against its content. For
          context (results file): two engines with a private pool each, as before the service.
  fetch   one long prefix from host memory into the KV, in-process pool vs the daemon's shared
          memory mapped in place, 41 repetitions alternating after an untimed warm-up round,
          both with one copy thread per core: ``fetch_ratio_vs_in_process`` = median in-process
          time / median daemon time (1.0: no cost for sharing). A fetch is ~20 ms here: with 9
          repetitions, the first ones warm-up, R moved by more than the goal's margin between
          quiet runs of the same code.
  attach  ms for an engine to connect its scheduler and worker sides to a running daemon,
          present its fingerprint, get the host pools' fds and map them (median of 7).
  mla     TP=2 rank processes (vLLM's worker role), an MLA layout (the same latents on every
          rank) stored once vs the same layout kept per rank: ``mla_bytes_ratio`` (goal 1/TP).
  ssd_io  where an SSD chunk is read (issue #43): the engine's worker reads it with io_uring
          + O_DIRECT (today) vs a process in the service's place reads it into shared memory
          and the engine copies it in place (``support/service_reads.py``), one prefix on the
          SSD only, alternating: ``ssd_io_engine_vs_service`` = median service-side time /
          median engine-side time (above 1: reading in the engine is faster).
  soak    two engines and the daemon; one engine saving in a loop is killed with SIGKILL (after
          reserving chunks it half-wrote), the other keeps fetching and checking: wrong bytes.

    python benchmarks/bench_kvpool_node.py --out out            # default run, < 10 min
    python benchmarks/bench_kvpool_node.py --short --out out    # a quick look

Results are appended to ``<out>/kvpool_node.jsonl`` as they come. The soak line comes second to
last; the last line: shared_hit_rate=H single_engine_hit_rate=H1 mla_bytes_ratio=M
attach_overhead_ms=A fetch_ratio_vs_in_process=R ssd_io_engine_vs_service=S
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from support.kvpool_node import (  # noqa: E402
    Daemon,
    EngineProcess,
    pool_config,
    run_tp,
    start_tp,
)


class Results:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "kvpool_node.jsonl"

    def add(self, kind: str, **row: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **row}) + "\n")
        print(kind, json.dumps(row), flush=True)


def in_process(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, "service": None}


def trace(n: int, prefixes: int, prefix_blocks: int, tail_blocks: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"seq": 1000 + i, "prefix_of": rng.randrange(prefixes),
             "shared": prefix_blocks, "blocks": prefix_blocks + tail_blocks}
            for i in range(n)]  # fmt: skip


def run_trace(engines: list[EngineProcess], reqs: list[dict]) -> tuple[float, int]:
    """(hit rate in blocks, wrong bytes): each request fetches, then saves (as served)."""
    hit = asked = wrong = 0
    for i, r in enumerate(reqs):
        e = engines[i % len(engines)]
        got = e.call("fetch", **r)
        hit, asked, wrong = hit + got["hit_blocks"], asked + r["blocks"], wrong + got["wrong_bytes"]
        e.call("save", **r)
    return hit / asked, wrong


def bench_trace(work: Path, res: Results, n: int) -> tuple[float, float]:
    reqs = trace(n, prefixes=6, prefix_blocks=24, tail_blocks=8, seed=43)
    sock = work / "trace" / "run" / "pool.sock"
    (work / "trace").mkdir(parents=True)
    cfg = pool_config(work / "trace", sock, host="2MiB", ssd="4MiB")
    one = EngineProcess(in_process(cfg), work / "trace" / "single.log")
    h1, wrong1 = run_trace([one], reqs)
    one.stop()
    (work / "trace" / "ssd.bin").unlink(missing_ok=True)
    private = []  # today: two engines, each with its own pool of the same size
    for i in range(2):
        (work / "trace" / f"own{i}").mkdir()
        private.append(EngineProcess(in_process(pool_config(work / "trace" / f"own{i}", sock,
                                                            host="2MiB", ssd="4MiB")),
                                     work / "trace" / f"own{i}.log"))  # fmt: skip
    h_private, wrong_private = run_trace(private, reqs)
    for e in private:
        e.stop()
    wrong1 += wrong_private
    daemon = Daemon(cfg, sock, work / "trace" / "daemon.log")
    try:
        pair = [EngineProcess(cfg, work / "trace" / f"e{i}.log") for i in range(2)]
        h, wrong = run_trace(pair, reqs)
        for e in pair:
            e.stop()
    finally:
        daemon.stop()
    res.add("trace", requests=n, single_engine_hit_rate=h1, shared_hit_rate=h,
            private_pools_hit_rate=h_private, wrong_bytes=wrong1 + wrong)  # fmt: skip
    if wrong1 + wrong:
        raise SystemExit(f"trace: {wrong1 + wrong} wrong bytes fetched")
    return h, h1


def bench_fetch(work: Path, res: Results, reps: int, layers: int,
                blocks: int) -> tuple[float, float]:  # fmt: skip
    """(fetch_ratio_vs_in_process, attach ms)."""
    d = work / "fetch"
    d.mkdir()
    sock = d / "run" / "pool.sock"
    chunk_bytes = 2 * layers * 8192
    host = f"{(blocks // 2 + 8) * chunk_bytes // 2**20 + 2}MiB"
    # The same copy threads for both (each engine's probe could pick differently): the cores.
    cfg = pool_config(d, sock, host=host, ssd="", copy_threads=min(8, os.cpu_count() or 1))
    daemon = Daemon(cfg, sock, d / "daemon.log")
    try:
        local = EngineProcess(in_process(cfg), d / "local.log", kv=(layers, blocks))
        remote = [EngineProcess(cfg, d / f"remote{i}.log", kv=(layers, blocks)) for i in range(2)]
        attach = remote[1].call("attach", times=7)["attach_ms"]
        req = {"seq": 7, "blocks": blocks}
        local.call("save", **req)
        remote[0].call("save", **req)
        times: dict[str, list[float]] = {"in_process": [], "daemon": []}
        for rep in range(reps + 1):  # the first round warms both paths up, untimed
            order = [("in_process", local), ("daemon", remote[1])]
            for name, e in order if rep % 2 == 0 else order[::-1]:
                got = e.call("fetch", **req)
                if got["hit_blocks"] != blocks or got["wrong_bytes"]:
                    raise SystemExit(f"fetch {name}: {got}")
                if rep:
                    times[name].append(got["seconds"])
        for e in (local, *remote):
            e.stop()
    finally:
        daemon.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["in_process"] / med["daemon"]
    res.add("fetch", layers=layers, blocks=blocks, mib=blocks * layers * 8192 / 2**20,
            seconds=times, median_s=med, fetch_ratio_vs_in_process=ratio,
            attach_ms=attach, in_process_engine_build_ms=local.attached()["attach_ms"],
            daemon_engine_build_ms=remote[1].attached()["attach_ms"])  # fmt: skip
    return ratio, attach


def bench_ssd_io(work: Path, res: Results, reps: int, layers: int, blocks: int) -> float:
    """Issue #43: where an SSD chunk is read. (a) the engine's worker reads it (today), (b) a
    process in the service's place reads it into shared memory and the engine copies it in place
    (``support/service_reads.py``); one prefix held on the SSD only, same engine, same copy
    threads and the same host memory for staging, repetitions alternating.
    Returns median (b) / median (a): above 1, the engine-side reads are faster."""
    d = work / "ssd_io"
    d.mkdir()
    sock = d / "run" / "pool.sock"
    chunk_bytes = 2 * layers * 8192
    ssd = f"{(blocks // 2 + 8) * chunk_bytes // 2**20 + 2}MiB"
    cfg = pool_config(d, sock, host="", ssd=ssd, copy_threads=min(8, os.cpu_count() or 1),
                      backend="uring", staging="16MiB")  # fmt: skip
    daemon = Daemon(cfg, sock, d / "daemon.log")
    try:
        e = EngineProcess(cfg, d / "engine.log", kv=(layers, blocks))
        req = {"seq": 11, "blocks": blocks}
        e.call("save", **req)
        times: dict[str, list[float]] = {"engine": [], "service": []}
        order = [("engine", "fetch"), ("service", "fetch_service_reads")]
        for rep in range(reps + 1):  # the first round warms both paths up, untimed
            for name, op in order if rep % 2 == 0 else order[::-1]:
                got = e.call(op, **req)
                if got["hit_blocks"] != blocks or got["wrong_bytes"] or not got["ok"]:
                    raise SystemExit(f"ssd_io {name}: {got}")
                if rep:
                    times[name].append(got["seconds"])
        e.stop()
    finally:
        daemon.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["service"] / med["engine"]
    mib = blocks * layers * 8192 / 2**20
    res.add("ssd_io", layers=layers, blocks=blocks, mib=mib, seconds=times, median_s=med,
            gbps={k: mib * 2**20 / v / 1e9 for k, v in med.items()},
            ssd_io_engine_vs_service=ratio)  # fmt: skip
    return ratio


def bench_mla(work: Path, res: Results) -> float:
    runs = {"replicated": start_tp(work / "mla", True, 2),
            "per_rank": start_tp(work / "mla-per-rank", False, 2)}  # fmt: skip
    stored, wrong = {}, 0
    for name, run in runs.items():
        w, stored[name], committed = run_tp(*run)
        wrong += sum(w)
        res.add("mla", layout=name, stored_bytes=stored[name], wrong_bytes=w,
                committed_per_rank=committed)  # fmt: skip
    if wrong:
        raise SystemExit(f"mla: {wrong} wrong bytes loaded")
    return stored["replicated"] / stored["per_rank"]


def bench_soak(work: Path, res: Results, seconds: float) -> str:
    d = work / "soak"
    d.mkdir()
    sock = d / "run" / "pool.sock"
    cfg = pool_config(d, sock, host="2MiB", ssd="4MiB")
    daemon = Daemon(cfg, sock, d / "daemon.log")
    counts = {"a_saves": 0, "b_fetches": 0, "b_hit_blocks": 0, "wrong_bytes": 0}
    stop = threading.Event()
    try:
        a, b = EngineProcess(cfg, d / "a.log"), EngineProcess(cfg, d / "b.log")
        saved: list[dict] = []
        rng = random.Random(7)

        def a_loop() -> None:
            i = 0
            while not stop.is_set():
                r = {"seq": 5000 + i, "prefix_of": i % 4, "shared": 16, "blocks": 24}
                try:
                    a.call("save", **r)
                except (RuntimeError, BrokenPipeError, ValueError):
                    return  # killed
                saved.append(r)
                counts["a_saves"] += 1
                i += 1

        ta = threading.Thread(target=a_loop)
        ta.start()
        deadline = time.monotonic() + seconds
        killed = False
        while time.monotonic() < deadline:
            if not killed and time.monotonic() > deadline - seconds / 2:
                stop.set()
                ta.join()
                a.call("plan", seq=99999, blocks=24, scribble=True)  # a save in flight...
                a.kill()  # ...and the engine dies
                killed = True
            if saved:
                r = rng.choice(saved)
                got = b.call("fetch", **r)
                counts["b_fetches"] += 1
                counts["b_hit_blocks"] += got["hit_blocks"]
                counts["wrong_bytes"] += got["wrong_bytes"]
                b.call("save", **{**r, "seq": r["seq"] + 100000})
        b.stop()
    finally:
        stop.set()
        daemon.stop()
    res.add("soak", seconds=seconds, **counts)
    return (f"soak engines=2 killed=1 a_saves={counts['a_saves']} b_fetches={counts['b_fetches']} "
            f"b_hit_blocks={counts['b_hit_blocks']} wrong_bytes={counts['wrong_bytes']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "out")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--short", action="store_true", help="small sizes, a quick look")
    args = p.parse_args()
    res = Results(args.out)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvpool-node-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        h, h1 = bench_trace(work, res, 24 if args.short else 96)
        r, a = bench_fetch(work, res, 3 if args.short else 41, 8 if args.short else 32,
                           64 if args.short else 512)  # fmt: skip
        sio = bench_ssd_io(work, res, 3 if args.short else 9, 8 if args.short else 32,
                           64 if args.short else 1024)  # fmt: skip
        m = bench_mla(work, res)
        soak = bench_soak(work, res, 10 if args.short else 60)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    res.add("total", seconds=time.monotonic() - t0)
    print(soak)
    print(f"shared_hit_rate={h:.3f} single_engine_hit_rate={h1:.3f} mla_bytes_ratio={m:.3f} "
          f"attach_overhead_ms={a:.1f} fetch_ratio_vs_in_process={r:.3f} "
          f"ssd_io_engine_vs_service={sio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
