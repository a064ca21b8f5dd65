"""The engine side of the pool service: ``RemotePool`` (the scheduler's pool, with
``UnifiedPool``'s methods, answered by the daemon) and ``attach_handlers`` (a worker rank's media,
its host pools being the daemon's shared memory mapped in place).

Both connect through ``ServiceClient``, which starts the daemon when none answers (with this
engine's pool config; ``autostart``), attaches with the engine's layout fingerprint, and on a lost
connection (the daemon restarted) connects and attaches again once before giving up.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_kvpool.config import PoolConfig, PoolConfigError, ServiceConfig, parse_pool_config
from vllm_kvpool.index import BlockHash, ChunkEntry, ChunkHit
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.metrics import LookupCounters, PoolStatus, TransferCounters
from vllm_kvpool.pool import GroupBlockIds, PlannedSave, read_jobs, save_job
from vllm_kvpool.protocol import ChunkRead, ChunkSave, WorkerReport
from vllm_kvpool.service import codec, wire

logger = logging.getLogger("vllm_kvpool")


class ServiceError(RuntimeError):
    """The pool service refused a request or cannot be reached."""


class ServiceUnavailable(ServiceError):
    """No pool service answers (it is down or restarting)."""


RETRY_INTERVAL_S = 1.0  # while the service is down, dial it again at most this often


def start_daemon(config: PoolConfig, socket_path: str) -> subprocess.Popen:
    """``kvpool daemon`` for ``config`` in its own session (it outlives this engine)."""
    cfg = {**config.to_dict(), "service": None}
    log = open(f"{socket_path}.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm_kvpool.cli", "daemon", "--socket", socket_path,
             "--config", json.dumps(cfg)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)  # fmt: skip
    finally:
        log.close()


class ServiceClient:
    """One attached connection to the pool service (thread-safe request/reply)."""

    def __init__(self, service: ServiceConfig, config: PoolConfig, attach: dict[str, Any],
                 on_attach: Callable[[dict[str, Any], list[int]], None] | None = None) -> None:  # fmt: skip
        self.service = service
        self.config = config
        self.attach_msg = {"op": "attach", **attach}
        self.on_attach = on_attach
        self.epoch = ""
        self.reply: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self._connect(self.service.start_timeout)

    def _dial(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.service.socket)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                return None
            raise ServiceError(f"kvpool service {self.service.socket}: {exc}") from None

    def _connect(self, wait: float) -> None:
        """Dial (starting the daemon first when none answers and ``autostart``: then waiting up
        to ``start_timeout`` for it), else waiting up to ``wait`` s, then attach."""
        sock = self._dial()
        if sock is None and self.service.autostart:
            sock = self._start()
            wait = self.service.start_timeout
        elif sock is None:
            sock = self._await(time.monotonic() + wait, None)
        if sock is None:
            raise ServiceUnavailable(f"no kvpool service answers at {self.service.socket} after "
                                     f"{wait:g} s"
                                     + ("" if self.service.autostart else " (autostart is off)"))
        wire.send(sock, self.attach_msg)
        reply, fds = wire.recv(sock, with_fds=True)
        if not reply.get("ok"):
            wire.close_fds(fds)
            sock.close()
            raise PoolConfigError("service", f"the kvpool service at {self.service.socket} "
                                  f"refused this engine: {reply.get('error')}")  # fmt: skip
        self._sock, self.reply, self.epoch = sock, reply, reply["epoch"]
        try:
            if self.on_attach is not None:
                self.on_attach(reply, fds)
        finally:
            wire.close_fds(fds)

    def _start(self) -> socket.socket | None:
        """Start the daemon unless a racing engine does. The engines of a node take turns on an
        ``flock`` of ``<socket>.start`` and only one that still finds no answer under it starts
        one, so racing engines spawn exactly one daemon (the daemon's own lock would also leave
        one serving, but a loser would still cost a process start). The kernel drops the lock
        of an engine killed while starting, and the next one starts the daemon again."""
        os.makedirs(os.path.dirname(self.service.socket) or ".", mode=0o700, exist_ok=True)
        deadline = time.monotonic() + self.service.start_timeout
        fd = os.open(f"{self.service.socket}.start", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)  # fmt: skip
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(0.05)
            sock = self._dial()
            if sock is None:
                sock = self._await(deadline, start_daemon(self.config, self.service.socket))
            return sock
        finally:
            os.close(fd)

    def _await(self, deadline: float, proc: subprocess.Popen | None) -> socket.socket | None:
        """Dial until ``deadline``; a daemon ``proc`` this engine started that fails ends it."""
        sock = None
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.05)
            sock = self._dial()
            if sock is None and proc is not None and proc.poll() not in (None, 0):
                raise ServiceError(f"kvpool daemon for {self.service.socket} exited with "
                                   f"{proc.returncode} (see {self.service.socket}.log)")  # fmt: skip
        return sock

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The service's reply; ``ServiceUnavailable`` at once while it is down (dialled again
        every ``RETRY_INTERVAL_S``), ``ServiceError`` when it refuses the request."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        if time.monotonic() < self._down_until:
                            raise ServiceUnavailable(f"kvpool service {self.service.socket} is "
                                                     "down")  # fmt: skip
                        try:
                            self._connect(0.0)
                        except ServiceUnavailable:
                            self._down_until = time.monotonic() + RETRY_INTERVAL_S
                            raise
                    assert self._sock is not None
                    wire.send(self._sock, msg)
                    reply, _ = wire.recv(self._sock)
                    break
                except (OSError, EOFError, wire.WireError) as exc:
                    self._drop()
                    if attempt:
                        raise ServiceUnavailable(f"kvpool service {self.service.socket}: "
                                                 f"{exc}") from None  # fmt: skip
                    logger.warning("kvpool: lost the pool service (%s); attaching again", exc)
            if not reply.get("ok"):
                raise ServiceError(f"kvpool service: {msg.get('op')}: {reply.get('error')}")
            return reply

    def follow(self, epoch: str) -> None:
        """Attach again when the pool's other side already runs under a newer service (it
        restarted: its host memory is new), before touching any chunk planned there."""
        if epoch and epoch != self.epoch:
            with self._lock:
                self._drop()
                self._connect(self.service.start_timeout)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def _attach_fields(layout: ChunkLayout, role: str, engine: str, rank: int,
                   world_size: int) -> dict[str, Any]:  # fmt: skip
    return {"role": role, "engine": engine, "rank": rank, "world_size": world_size,
            "layout": codec.layout_to_wire(layout)}  # fmt: skip


class RemotePool:
    """``UnifiedPool``'s methods, answered by the pool service (the scheduler's pool when the
    config has ``service``). Entries it returns are copies; pins go to the service by key and
    are this engine's leases there."""

    def __init__(self, config: PoolConfig, layout: ChunkLayout, world_size: int,
                 engine: str) -> None:  # fmt: skip
        assert config.service is not None
        self.layout = layout
        self.world_size = world_size
        self.client = ServiceClient(config.service, config,
                                    _attach_fields(layout, "scheduler", engine, 0, world_size))
        self.config = parse_pool_config(self.client.reply["config"])

        self._down = False
        self._last_status: PoolStatus | None = None

    @property
    def epoch(self) -> str:
        return self.client.epoch

    def _call(self, op: str, fallback: Any = None, **fields: Any) -> Any:
        """The reply, or ``fallback`` while the service is down: the engine serves on without
        the pool (lookups miss, nothing is saved) until it answers again."""
        try:
            reply = self.client.request({"op": op, **fields})
        except ServiceUnavailable as exc:
            if not self._down:
                logger.error("kvpool: %s; serving without the pool until it answers", exc)
                self._down = True
            return fallback
        if self._down:
            logger.warning("kvpool: the pool service answers again (epoch %s)", self.epoch)
            self._down = False
        return reply

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[ChunkHit]:
        return self.lookup_pending(hashes)[0]

    def lookup_pending(self, hashes: Sequence[BlockHash]) -> tuple[list[ChunkHit], int]:
        if not hashes:
            return [], 0
        reply = self._call("lookup", {"hits": [], "pending": 0}, hashes=wire.hexes(hashes))
        # a running service of an earlier release (same wire version) replies without it
        return codec.hits_from_wire(reply["hits"]), int(reply.get("pending", 0))

    def load_jobs(self, hits: Sequence[ChunkHit], group_ids: GroupBlockIds, load_from: int = 0,
                  hit_end: int | None = None) -> list[tuple[ChunkRead, ChunkEntry]]:  # fmt: skip
        return read_jobs(self.layout, hits, group_ids, load_from, hit_end)

    def is_stored(self, hashes: Sequence[BlockHash]) -> bool:
        return bool(self._call("is_stored", {"value": False}, hashes=wire.hexes(hashes))["value"])

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self._call("record_lookup", query_tokens=query_tokens, hit_tokens=hit_tokens)

    def record_load(self, entries: Sequence[ChunkEntry]) -> None:
        self._call("record_load", keys=wire.hexes([e.key for e in entries]))

    def pin(self, entries: Sequence[ChunkEntry]) -> None:
        if entries:
            self._call("pin", keys=wire.hexes([e.key for e in entries]))

    def unpin(self, entries: Sequence[ChunkEntry]) -> None:
        if entries:
            self._call("unpin", keys=wire.hexes([e.key for e in entries]))

    # -- saves -----------------------------------------------------------------------------
    def shorter_copy_unsettled(self, hashes: Sequence[BlockHash]) -> bool:
        return bool(self._call("shorter_copy_unsettled", {"value": False},
                               hashes=wire.hexes(hashes))["value"])  # fmt: skip

    def plan_saves(self, req_id: str,
                   chunks: Sequence[tuple[int, Sequence[BlockHash]]]) -> list[PlannedSave]:  # fmt: skip
        if not chunks:
            return []
        reply = self._call("plan_saves", {"planned": []}, req_id=req_id, chunks=[
            {"first": first, "hashes": wire.hexes(hs)} for first, hs in chunks])  # fmt: skip
        out = []
        for p in reply["planned"]:
            entry = codec.entry_from_wire(p["entry"])
            entry.committed = False
            out.append(PlannedSave(entry, p["first"]))
        return out

    def save_jobs(self, req_id: str, chunks: Sequence[tuple[int, Sequence[BlockHash]]],
                  group_ids: GroupBlockIds) -> list[ChunkSave]:  # fmt: skip
        return [save_job(self.layout, req_id, p, group_ids) for p in self.plan_saves(req_id, chunks)]

    def forget_request(self, req_id: str) -> None:
        self._call("forget_request", req_id=req_id)

    def invalidate(self, key: BlockHash) -> None:
        self._call("invalidate", keys=[key.hex()])

    def apply_report(self, report: WorkerReport) -> list[BlockHash]:
        if report.is_empty():
            return []
        # Down: every save the workers report is settled (nothing will index it any more).
        down = {"settled": wire.hexes([k for k, _, _ in report.committed] + report.failed_saves)}
        reply = self._call("apply_report", down, report=codec.report_to_wire(report))
        return [bytes.fromhex(k) for k in reply["settled"]]

    def clear(self) -> None:
        self._call("clear")

    def status(self) -> PoolStatus:
        """The node's pool (the last one seen while the service is down)."""
        reply = self._call("status")
        if reply is not None:
            self._last_status = PoolStatus.from_dict(reply["status"])
        elif self._last_status is None:
            return PoolStatus([], LookupCounters(), TransferCounters(), self.config.placement,
                              self.config.chunk_tokens)  # fmt: skip
        return self._last_status

    def close(self) -> None:
        self.client.close()


def attach_handlers(config: PoolConfig, layout: ChunkLayout, rank: int, world_size: int,
                    engine: str) -> tuple[ServiceClient, list[Any]]:  # fmt: skip
    """A worker rank's media for the service's pool: its host pools are the service's shared
    memory (mapped here, chunks read and written in place), its SSDs opened as in process
    (every engine opens the same files; the service hands out their slots). The client stays
    connected for the engine's lifetime: the service frees slots of a dead engine's unfinished
    writes only once every one of its connections is closed."""
    from vllm_kvpool.handlers import HostMemoryHandler, open_handler
    from vllm_kvpool.native import kvio

    assert config.service is not None
    handlers: list[Any] = []

    def mapped(reply: dict[str, Any], fds: list[int]) -> dict[int, Any]:
        return {h["device"]: kvio().HostPool.attach(fd, h["capacity"], name=f"host.rank{rank}")
                for h, fd in zip(reply["host"], fds, strict=True)}  # fmt: skip

    def build(reply: dict[str, Any], fds: list[int]) -> None:
        pool_config = parse_pool_config(reply["config"])
        host = mapped(reply, fds)
        suffix = f".rank{rank}" if world_size > 1 else ""
        for d, cfg in enumerate(pool_config.devices):
            if d in host:
                handlers.append(HostMemoryHandler(cfg, layout.slot_bytes, layout.num_slots(cfg),
                                                  pool=host[d]))  # fmt: skip
            else:
                handlers.append(open_handler(cfg, pool_config, layout, suffix))

    def rebind(reply: dict[str, Any], fds: list[int]) -> None:
        for d, pool in mapped(reply, fds).items():
            handlers[d].adopt(pool)

    client = ServiceClient(config.service, config,
                           _attach_fields(layout, "worker", engine, rank, world_size), build)
    client.on_attach = rebind  # a later attach (the service restarted) maps its new memory
    return client, handlers
