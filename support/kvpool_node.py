"""A node's pool service with engines as real processes, for the tests and the node benchmark.

``Daemon`` runs ``kvpool daemon`` as a child (stopped by its pid, or killed with SIGKILL).
``EngineProcess`` runs ``python -m support.kvpool_node`` as a child: one engine, a ``LocalPool``
over the service (the same ``RemotePool`` and shared host pools a vLLM engine uses), its KV
tensors filled with a pattern that names (sequence, block, layer), driven by JSON lines on
stdin. A fetch reports how many bytes differ from the pattern of the sequence it asked for.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
LAYERS = 2
NUM_BLOCKS = 64
PAGE_SHAPE = (2, BLOCK_SIZE, 2, 32)  # K/V, tokens, heads, head dim (int32: 8 KiB a block)
PAGE_BYTES = 4 * PAGE_SHAPE[0] * PAGE_SHAPE[1] * PAGE_SHAPE[2] * PAGE_SHAPE[3]


def pool_config(workdir: Path, socket_path: Path, host: str = "1MiB", ssd: str = "2MiB",
                chunk_tokens: int = 32, autostart: bool = False, copy_threads: int = 0,
                backend: str = "posix", staging: str = "1MiB") -> dict[str, Any]:  # fmt: skip
    devices: list[dict[str, Any]] = []
    if host:
        devices.append({"host": {"capacity": host, "bandwidth_gbps": 2.0}})
    if ssd:
        devices.append({"ssd": {"path": str(workdir / "ssd.bin"), "capacity": ssd,
                                "backend": backend, "bandwidth_gbps": 1.0}})  # fmt: skip
    return {"chunk_tokens": chunk_tokens, "devices": devices, "staging": staging,
            "copy_threads": copy_threads,
            "service": {"socket": str(socket_path), "autostart": autostart,
                        "start_timeout": 60}}  # fmt: skip


def block_hashes(seq: int, blocks: int, prefix_of: int | None = None,
                 shared: int | None = None) -> list[bytes]:  # fmt: skip
    """A chained block-hash list (as vLLM's): sequences built from the same ``prefix_of`` seed
    share their first ``shared`` blocks (default all), then go on as ``seq``'s own."""
    out, h = [], hashlib.sha256(f"seq{seq if prefix_of is None else prefix_of}".encode()).digest()
    for b in range(blocks):
        if b == shared:
            h = hashlib.sha256(h + f"own{seq}".encode()).digest()
        h = hashlib.sha256(h + b.to_bytes(4, "little")).digest()
        out.append(h)
    return out


def block_seed(cmd: dict[str, Any], block: int) -> int:
    """Whose content a block holds: the shared prefix's seed, then the sequence's own."""
    seq = cmd.get("seq", 0)
    return cmd.get("prefix_of", seq) if block < cmd.get("shared", 1 << 30) else seq


def pattern(seq: int, block: int, layer: int) -> torch.Tensor:
    n = 1
    for d in PAGE_SHAPE:
        n *= d
    base = (seq * 1_000_003 + block * 7_919 + layer * 104_729) % (2**31 - n)
    return (torch.arange(n, dtype=torch.int32) + base).view(PAGE_SHAPE)


@functools.lru_cache(maxsize=2)
def expected_kv(seeds: tuple[int, ...], layers: int) -> tuple[torch.Tensor, ...]:
    """Every layer's content for blocks ``0..len(seeds)-1``, block b holding ``seeds[b]``'s
    pattern: built once per sequence (the node benchmark fills and checks the same 128 MiB
    prefix on every repetition; a pattern per block and layer cost ~1 s each time)."""
    return tuple(torch.stack([pattern(s, b, layer) for b, s in enumerate(seeds)])
                 for layer in range(layers))  # fmt: skip


def _seeds(cmd: dict[str, Any], blocks: int) -> tuple[int, ...]:
    return tuple(block_seed(cmd, b) for b in range(blocks))


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def daemon_pids(socket_path: Path) -> list[int]:
    """Processes running ``kvpool daemon`` on this socket (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daemon" in args and str(socket_path).encode() in args and d.name.isdigit():
            out.append(int(d.name))
    return out


def stop_daemons(socket_path: Path) -> None:
    """SIGTERM every ``kvpool daemon`` on this socket (an autostarted one is no child of the
    test: it runs in its own session)."""
    for pid in daemon_pids(socket_path):
        os.kill(pid, signal.SIGTERM)


def daemon_connections(socket_path: Path) -> int:
    """Connections the daemon on ``socket_path`` still holds open (from /proc/net/unix: the
    sockets it accepted carry the socket's path). It closes one only after dropping that
    session (its leases and unsettled writes), so a killed engine's are gone once this falls."""
    with open("/proc/net/unix") as f:
        next(f)  # Num RefCount Protocol Flags Type St Inode Path
        rows = [line.split(maxsplit=7) for line in f]
    return sum(1 for r in rows if len(r) == 8 and r[5] == "03" and r[7].strip() == str(socket_path))


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` s (generous: a
    loaded 2-core CI machine may starve the process that makes it true)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not after {timeout:g} s: {what}")
        time.sleep(0.02)


class Daemon:
    def __init__(self, config: dict[str, Any], socket_path: Path, log: Path) -> None:
        self.socket_path = socket_path
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_kvpool.cli", "daemon", "--socket", str(socket_path),
                 "--config", json.dumps(config)], cwd=REPO, stdout=f, stderr=f)  # fmt: skip
        deadline = time.monotonic() + 60
        while not _answers(socket_path):  # a dead daemon's socket file may still be there
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvpool daemon did not start: {log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=30)


class EngineProcess:
    def __init__(self, config: dict[str, Any], log: Path, wait: bool = True,
                 rank: tuple[dict[str, Any], int, int] | None = None,
                 kv: tuple[int, int] = (LAYERS, NUM_BLOCKS)) -> None:  # fmt: skip
        """``wait`` False: return at once (engines started together race to attach);
        ``attached()`` waits. ``rank``: (layout on the wire, rank, world size): one TP rank's
        worker role instead of a whole engine. ``kv``: (layers, blocks) of an engine's KV."""
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        args = [json.dumps(config), str(kv[0]), str(kv[1])] if rank is None else [
            "rank", json.dumps(config), json.dumps(rank[0]), str(rank[1]), str(rank[2])]
        self.proc = subprocess.Popen([sys.executable, "-m", "support.kvpool_node", *args],
                                     cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)  # fmt: skip
        self.ready: dict[str, Any] = {}
        if wait:
            self.attached()

    def attached(self) -> dict[str, Any]:
        """The engine's first line: its attach time (ms) and pid."""
        if not self.ready:
            self.ready = self._read()
        return self.ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited ({self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def step(self, op: str, meta: Any = None, **args: Any) -> dict[str, Any]:
        """A rank's step: ``meta`` (``PoolStepMetadata``) pickled down, its report back."""
        if meta is not None:
            args["meta"] = base64.b64encode(pickle.dumps(meta)).decode()
        out = self.call(op, **args)
        out["report"] = pickle.loads(base64.b64decode(out["report"]))
        return out

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.log.close()


def start_tp(tmp_path: Path, replicated: bool, tp: int) -> tuple[Daemon, dict[str, Any], Any, list]:
    """A daemon and ``tp`` rank processes over an MLA-like (``replicated``) or a per-rank
    layout; the ranks are not waited for (several runs' ranks start together)."""
    from vllm_kvpool.layout import ChunkLayout, GroupLayout
    from vllm_kvpool.service import codec

    tmp_path.mkdir()
    sock = tmp_path / "run" / "pool.sock"
    cfg = pool_config(tmp_path, sock)
    daemon = Daemon(cfg, sock, tmp_path / "daemon.log")
    layout = ChunkLayout((GroupLayout(0, tuple(f"layer{i}" for i in range(LAYERS)), PAGE_BYTES,
                                      BLOCK_SIZE),), 2, layout_version=4343, replicated=replicated)  # fmt: skip
    ranks = [EngineProcess(cfg, tmp_path / f"rank{r}.log", wait=False,
                           rank=(codec.layout_to_wire(layout), r, tp)) for r in range(tp)]  # fmt: skip
    return daemon, cfg, layout, ranks


def run_tp(daemon: Daemon, cfg: dict[str, Any], layout: Any, ranks: list) -> tuple[list, int, list]:
    """Save 12 blocks through the TP ranks, load them back on both: (wrong bytes per rank,
    stored bytes, chunks each rank committed)."""
    from vllm_kvpool.config import load_pool_config
    from vllm_kvpool.connector_meta import PoolStepMetadata
    from vllm_kvpool.protocol import LoadRequest, WorkerReport
    from vllm_kvpool.service.remote import RemotePool

    try:
        for r in ranks:
            r.attached()
        pool = RemotePool(load_pool_config(cfg), layout, 1 if layout.replicated else len(ranks), "tp")
        hashes, ids = block_hashes(5, 12), list(range(12))
        for r in ranks:
            r.step("fill", seq=5, blocks=12)
        jobs = pool.save_jobs("req", [(f, hashes[f:f + 2]) for f in range(0, 12, 2)], [ids])
        report = WorkerReport()
        committed = []
        for r in ranks:
            got = r.step("save", PoolStepMetadata(saves=jobs))["report"]
            committed.append(len(got.committed) if got else 0)
            if got:
                report.merge(got)
        pool.apply_report(report)
        hits = pool.lookup(hashes)
        assert sum(h.num_blocks for h in hits) == 12
        reads = pool.load_jobs(hits, [ids])
        meta = PoolStepMetadata(loads=[LoadRequest("load", tuple(j for j, _ in reads), True)])
        wrong = [r.step("load", meta, seq=5, blocks=12)["wrong_bytes"] for r in ranks]
        stored = pool.status().stored_bytes
        pool.close()
        return wrong, stored, committed
    finally:
        for r in ranks:
            r.stop()
        daemon.stop()


def _engine_main(config: dict[str, Any], layers: int, num_blocks: int) -> None:
    from vllm_kvpool.local import LocalPool

    kv = {f"layer{i}": torch.zeros((num_blocks, *PAGE_SHAPE), dtype=torch.int32)
          for i in range(layers)}  # fmt: skip
    t0 = time.perf_counter()
    try:
        pool = LocalPool(config, kv, num_blocks, BLOCK_SIZE, layout_id="node-test")
    except Exception as exc:  # the parent reads why (a refused attach, ...)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"attach_ms": (time.perf_counter() - t0) * 1e3, "pid": os.getpid()}),
          flush=True)  # fmt: skip
    held = []
    service_reads = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op, seq, blocks = cmd["op"], cmd.get("seq", 0), cmd.get("blocks", 0)
        hashes = block_hashes(seq, blocks, cmd.get("prefix_of"), cmd.get("shared"))
        ids = list(range(blocks))
        if op == "save":
            want = expected_kv(_seeds(cmd, blocks), layers)
            for name, t in kv.items():
                t[:blocks] = want[int(name.removeprefix("layer"))]
            out: dict[str, Any] = {"committed": pool.save(hashes, ids)}
        elif op == "fetch":
            for t in kv.values():
                t.zero_()
            r = pool.fetch(hashes, ids)
            out = {"hit_blocks": r.blocks, "ok": r.ok, "seconds": r.seconds,
                   "wrong_bytes": _wrong_bytes(kv, cmd, r.blocks)}  # fmt: skip
        elif op == "fetch_service_reads":  # #43's option (b): the SSD read by another process
            if service_reads is None:
                from support.service_reads import ServiceReads

                ssd = next(d for d, h in enumerate(pool.handlers) if not h.resident)
                service_reads = ServiceReads(pool, ssd, sys.stderr.buffer)
            for t in kv.values():
                t.zero_()
            blocks_hit, seconds, ok = service_reads.fetch(hashes, ids, pool.engine.loads.copy_threads)
            out = {"hit_blocks": blocks_hit, "ok": ok, "seconds": seconds,
                   "wrong_bytes": _wrong_bytes(kv, cmd, blocks_hit)}  # fmt: skip
        elif op == "pin":  # hold leases on the stored prefix (as a load in flight does)
            entries = [h.entry for h in pool.pool.lookup(hashes)]
            pool.pool.pin(entries)
            held += entries
            out = {"pinned": len(entries)}
        elif op == "plan":  # reserve slots and leave the chunks unwritten (a save in flight)
            bpc = pool.layout.blocks_per_chunk
            jobs = pool.pool.save_jobs("inflight", [(f, hashes[f : f + bpc])
                                                    for f in range(0, blocks, bpc)], [ids])  # fmt: skip
            for job in jobs if cmd.get("scribble") else ():  # half a gather's bytes, then death
                handler = pool.handlers[job.device]
                if handler.resident:
                    view = handler.view(job.slot, pool.layout.nbytes(job.num_blocks))
                    view[: view.numel() // 2] = 0xAB
            out = {"planned": len(jobs)}
        elif op == "attach":  # what attaching costs an engine: both sides' connections
            from vllm_kvpool.pools import open_media, open_pool

            ms = []
            for i in range(cmd.get("times", 5)):
                t = time.perf_counter()
                name = f"probe-{os.getpid()}-{i}"
                other = open_pool(pool.config, pool.layout, 1, name)
                client, handlers = open_media(pool.config, pool.layout, 0, 1, name)
                ms.append((time.perf_counter() - t) * 1e3)
                for h in handlers:
                    h.close()
                client.close()
                other.close()
            out = {"attach_ms": sorted(ms)[len(ms) // 2]}
        elif op == "status":
            out = pool.status().to_dict()
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    pool.pool.unpin(held)
    if service_reads is not None:
        service_reads.close()
    pool.close()


def _wrong_bytes(kv: dict[str, torch.Tensor], cmd: dict[str, Any], blocks: int) -> int:
    """Bytes of the first ``blocks`` blocks that differ from the sequence's pattern."""
    if not blocks:
        return 0
    want = expected_kv(_seeds(cmd, blocks), len(kv))
    wrong = 0
    for name, t in kv.items():
        got, ref = t[:blocks], want[int(name.removeprefix("layer"))]
        if not torch.equal(got, ref):  # counted only when some differ (the count allocates)
            wrong += int((got != ref).sum()) * 4
    return wrong


def _rank_main(config: dict[str, Any], layout: dict[str, Any], rank: int, world: int) -> None:
    """One tensor-parallel rank: vLLM's worker-side role (``PoolWorker``) over this process's KV,
    stepped by the parent (the scheduler side) with pickled step metadata."""
    from vllm_kvpool.config import load_pool_config
    from vllm_kvpool.service.codec import layout_from_wire
    from vllm_kvpool.worker import PoolWorker

    kv = {f"layer{i}": torch.zeros((NUM_BLOCKS, *PAGE_SHAPE), dtype=torch.int32)
          for i in range(LAYERS)}  # fmt: skip
    worker = PoolWorker(load_pool_config(config), layout_from_wire(layout), rank, world, "tp")
    worker.register_kv_caches(kv, NUM_BLOCKS)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, seq, blocks = cmd["op"], cmd.get("seq", 0), cmd.get("blocks", 0)
        meta = pickle.loads(base64.b64decode(cmd["meta"])) if "meta" in cmd else None
        out: dict[str, Any] = {}
        if op == "fill":  # MLA: every rank computed the same latents
            for name, t in kv.items():
                for b in range(blocks):
                    t[b] = pattern(seq, b, int(name.removeprefix("layer")))
        elif op == "save":
            for name in kv:
                worker.save_layer(meta, name)
            worker.finish_step(meta)
            worker.drain()
        elif op == "load":
            for t in kv.values():
                t.zero_()
            worker.start_load(meta)
            want = {r.req_id for r in meta.loads}
            deadline = time.monotonic() + 60
            while want and time.monotonic() < deadline:
                want -= worker.transfer_results(meta)[1]
                time.sleep(0.001)
            out["wrong_bytes"] = sum(
                int((t[b] != pattern(seq, b, int(name.removeprefix("layer")))).sum()) * 4
                for name, t in kv.items() for b in range(blocks))  # fmt: skip
        report = worker.worker_meta()
        out["report"] = base64.b64encode(pickle.dumps(report.report if report else None)).decode()
        print(json.dumps(out), flush=True)
    worker.close()


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        _rank_main(json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]),
                   int(sys.argv[5]))  # fmt: skip
    else:
        _engine_main(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
