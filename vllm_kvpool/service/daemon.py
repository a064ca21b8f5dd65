"""``kvpool daemon``: one pool service per node. It owns the host pools (shared memfds the
engines map in place), the index over host pools and SSDs, placement and eviction (the same
``UnifiedPool`` an engine runs in process) and serves them to every engine on the node through a
Unix socket (``wire``).

* **Attach.** A connection presents its role (``scheduler``: the engine's index side, or
  ``worker``: one rank mapping the host pools), its engine id, rank and world size, and the
  chunk layout with its fingerprint (model, dtype, TP layout, block hashing). The first attach
  fixes the pool's layout (and restores the SSD chunks a previous run left under it); a later
  one with another fingerprint or world size is refused with the reason. A worker gets its
  rank's host pools as fds (``SCM_RIGHTS``).
* **Leases.** A chunk a session pins is never evicted under another engine (the pool's reader
  count). When a connection closes (the engine exited or was killed) its pins drop and the chunks
  it was writing and had not committed leave the index; their slots are reused only once no
  connection of that engine is left (a worker might still be writing into them).
* **Security.** The socket's directory is created 0700 and the socket 0600; a peer whose uid
  (``SO_PEERCRED``) is not the service's is refused; the host pools' memfds are 0600 and reach
  engines only through the socket. A malformed message gets an error and changes nothing; one
  that breaks the framing (bad header, oversized, truncated) also closes that connection.
* **One per socket.** The service holds an exclusive ``flock`` on ``<socket>.lock`` while it
  runs, so a second daemon on the socket exits (engines starting one at once also take turns
  on ``<socket>.start``, so they spawn only one: ``remote.ServiceClient``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import signal
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.index import ChunkEntry
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.native import kvio
from vllm_kvpool.pool import UnifiedPool
from vllm_kvpool.pools import open_pool
from vllm_kvpool.service import codec, wire
from vllm_kvpool.service.wire import WireError
from vllm_kvpool.service.wire import field as wfield

logger = logging.getLogger("vllm_kvpool")
ROLES = ("scheduler", "worker")


class AlreadyServing(RuntimeError):
    """Another service holds this socket's lock."""


@dataclass
class Session:
    """One connection: an engine's scheduler side or one of its worker ranks."""

    pid: int
    uid: int
    role: str = ""
    engine: str = ""
    rank: int = 0
    leases: dict[bytes, list[ChunkEntry]] = field(default_factory=dict)  # pinned chunks
    # The last lookup's hits, pinned until this session's next lookup: another engine cannot
    # evict them between the lookup and the pin of the load that follows it.
    tentative: list[ChunkEntry] = field(default_factory=list)
    writing: dict[bytes, ChunkEntry] = field(default_factory=dict)  # planned, not settled


class PoolService:
    """The pool behind the socket; ``handle`` is the whole protocol (tests drive it directly)."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = replace(config, service=None)  # the daemon's pool is in its process
        self.epoch = secrets.token_hex(8)  # a restarted service is a new epoch: engines re-attach
        self.pool: UnifiedPool | None = None
        self.layout_wire: dict[str, Any] | None = None
        self.world_size = 0
        self.host_pools: dict[int, list[Any]] = {}  # device index -> one HostPool per rank
        self.sessions: dict[int, Session] = {}
        self.engines: dict[str, set[int]] = {}  # engine id -> its live session ids
        self.orphans: dict[str, list[ChunkEntry]] = {}  # slots freed once the engine is gone
        self.lock = threading.Lock()
        self._ops: dict[str, Callable[[Session, dict[str, Any]], dict[str, Any]]] = {
            "lookup": self._lookup, "is_stored": self._is_stored,
            "shorter_copy_unsettled": self._shorter_copy_unsettled,
            "plan_saves": self._plan_saves, "pin": self._pin, "unpin": self._unpin,
            "record_lookup": self._record_lookup, "record_load": self._record_load,
            "forget_request": self._forget_request, "invalidate": self._invalidate,
            "apply_report": self._apply_report, "clear": self._clear, "status": self._status,
        }  # fmt: skip

    # -- sessions --------------------------------------------------------------------------
    def open_session(self, sid: int, pid: int, uid: int) -> Session:
        with self.lock:
            self.sessions[sid] = s = Session(pid, uid)
            return s

    def close_session(self, sid: int) -> None:
        """The connection is gone: its pins drop, its unsettled writes leave the index."""
        with self.lock:
            s = self.sessions.pop(sid, None)
            if s is None or self.pool is None:
                return
            for entries in [*s.leases.values(), s.tentative]:
                self.pool.unpin(entries, completed=False)
            withdrawn = [e for e in s.writing.values() if self.pool.withdraw(e)]
            if withdrawn:
                logger.warning("kvpool daemon: engine %s (pid %d) left %d chunks unwritten; "
                               "dropped", s.engine, s.pid, len(withdrawn))  # fmt: skip
            live = self.engines.get(s.engine, set())
            live.discard(sid)
            self.orphans.setdefault(s.engine, []).extend(withdrawn)
            if not live:
                self.engines.pop(s.engine, None)
                for e in self.orphans.pop(s.engine, []):
                    self.pool.free_slot(e)

    def handle(self, sid: int, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """One request -> (reply, fds to pass). Never raises for a bad request."""
        try:
            op = wfield(msg, "op", str)
            with self.lock:
                s = self.sessions[sid]
                if op == "attach":
                    return self._attach(sid, s, msg)
                if not s.role:
                    raise WireError(f"op {op!r} before attach")
                handler = self._ops.get(op)
                if handler is None:
                    raise WireError(f"unknown op {op!r}")
                return {"ok": True, **handler(s, msg)}, []
        except WireError as exc:
            return {"ok": False, "error": exc.reason}, []
        except Exception as exc:  # a bug must not take the service down: say so, go on
            logger.exception("kvpool daemon: request %r failed", msg.get("op"))
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}, []

    # -- attach ----------------------------------------------------------------------------
    def _attach(self, sid: int, s: Session, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if s.role:
            raise WireError("this connection is already attached")
        role = wfield(msg, "role", str)
        if role not in ROLES:
            raise WireError(f"field 'role': {role!r} is not one of {', '.join(ROLES)}")
        engine = wfield(msg, "engine", str)
        world = wfield(msg, "world_size", int)
        rank = wfield(msg, "rank", int, 0)
        if not 1 <= world <= 1024 or not 0 <= rank < world or not 0 < len(engine) <= 128:
            raise WireError(f"fields 'world_size'/'rank'/'engine': rank {rank} of {world}, "
                            f"engine {engine[:40]!r}")  # fmt: skip
        layout_msg = wfield(msg, "layout", dict)
        layout = codec.layout_from_wire(layout_msg)
        if self.pool is None:
            self._create(layout, layout_msg, world)
        else:
            self._check_same(layout, layout_msg, world)
        s.role, s.engine, s.rank = role, engine, rank
        self.engines.setdefault(engine, set()).add(sid)
        reply = {"ok": True, "epoch": self.epoch, "config": self.config.to_dict(),
                 "world_size": self.world_size, "host": []}  # fmt: skip
        fds: list[int] = []
        if role == "worker":
            for device, pools in sorted(self.host_pools.items()):
                reply["host"].append({"device": device, "capacity": pools[rank].capacity})
                fds.append(pools[rank].fd)
        logger.info("kvpool daemon: %s of engine %s (pid %d, rank %d) attached", role, engine,
                    s.pid, rank)  # fmt: skip
        return reply, fds

    def _create(self, layout: ChunkLayout, layout_msg: dict[str, Any], world: int) -> None:
        bpc_tokens = layout.blocks_per_chunk * layout.groups[0].block_size
        if bpc_tokens != self.config.chunk_tokens:
            raise WireError(f"layout: chunks of {bpc_tokens} tokens, the service's pool "
                            f"stores chunks of {self.config.chunk_tokens}")  # fmt: skip
        try:
            layout.check_capacity(self.config)
        except ValueError as exc:
            raise WireError(f"layout: {exc}") from None
        pool = open_pool(self.config, layout, world, "daemon")  # SSD chunks restored
        assert isinstance(pool, UnifiedPool)
        io = kvio()
        for d, cfg in enumerate(self.config.devices):
            if cfg.kind == "host":
                self.host_pools[d] = [io.HostPool(layout.num_slots(cfg) * layout.slot_bytes,
                                                  numa_node=cfg.numa_node, shared=True,
                                                  name=f"{cfg.name}.rank{r}")
                                      for r in range(world)]  # fmt: skip
        self.pool, self.layout_wire, self.world_size = pool, layout_msg, world

    def _check_same(self, layout: ChunkLayout, layout_msg: dict[str, Any], world: int) -> None:
        assert self.pool is not None
        mine = self.pool.layout
        if layout.layout_version != mine.layout_version:
            raise WireError(f"layout fingerprint {layout.layout_version:#x} differs from the "
                            f"pool's {mine.layout_version:#x}: another model, dtype, TP layout, "
                            "block size or block hashing; this pool serves only its own")  # fmt: skip
        if world != self.world_size:
            raise WireError(f"world size {world} differs from the pool's {self.world_size}")
        if layout_msg != self.layout_wire:
            raise WireError("layout differs from the pool's (same fingerprint, other groups)")

    # -- the pool's methods ----------------------------------------------------------------
    def _lookup(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        hs = wire.hashes(msg, "hashes")
        self.pool.unpin(s.tentative, completed=False)
        hits, pending = self.pool.lookup_pending(hs)
        s.tentative = [h.entry for h in hits]
        self.pool.pin(s.tentative)
        return {"hits": codec.hits_to_wire(hits), "pending": pending}

    def _is_stored(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        hs = wire.hashes(msg, "hashes")
        return {"value": bool(hs) and self.pool.is_stored(hs)}

    def _shorter_copy_unsettled(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        hs = wire.hashes(msg, "hashes")
        return {"value": bool(hs) and self.pool.shorter_copy_unsettled(hs)}

    def _plan_saves(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        req_id = wfield(msg, "req_id", str)
        bpc = self.pool.layout.blocks_per_chunk
        chunks = []
        for i, c in enumerate(wfield(msg, "chunks", list)):
            where = f"chunks[{i}]"
            if not (isinstance(c, dict) and isinstance(c.get("first"), int) and c["first"] >= 0):
                raise WireError(f"field {where!r}: expected {{first: int >= 0, hashes: [hex]}}")
            hs = wire.hashes(c, "hashes")
            if not 1 <= len(hs) <= bpc:
                raise WireError(f"field {where!r}: {len(hs)} block hashes, a chunk has 1..{bpc}")
            chunks.append((c["first"], hs))
        planned = self.pool.plan_saves(f"{s.engine}/{req_id}", chunks)
        for p in planned:
            s.writing[p.entry.key] = p.entry
        return {"planned": [{"entry": codec.entry_to_wire(p.entry), "first": p.first_block}
                            for p in planned]}  # fmt: skip

    def _pin(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        """Lease chunks of this session's last lookup (already pinned by it) or, failing that,
        chunks in the index now; all of them or none."""
        assert self.pool is not None
        held = {e.key: e for e in s.tentative}
        entries, fresh = [], []
        for key in wire.hashes(msg, "keys"):
            entry = held.pop(key, None)
            if entry is None:
                entry = self.pool.index.get(key)
                if entry is None:
                    raise WireError(f"chunk {key.hex()[:16]} is not in the pool")
                fresh.append(entry)
            entries.append(entry)
        self.pool.pin(fresh)
        for entry in entries:
            s.leases.setdefault(entry.key, []).append(entry)
        s.tentative = list(held.values())
        return {}

    def _unpin(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        """Unpins this session's leases only (an unknown key: already dropped, ignored)."""
        assert self.pool is not None
        entries = []
        for key in wire.hashes(msg, "keys"):
            held = s.leases.get(key)
            if held:
                entries.append(held.pop())
                if not held:
                    del s.leases[key]
        self.pool.unpin(entries)
        return {}

    def _record_lookup(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        query, hit = wfield(msg, "query_tokens", int), wfield(msg, "hit_tokens", int)
        if not 0 <= hit <= query:
            raise WireError(f"fields 'query_tokens'/'hit_tokens': {hit} hits of {query}")
        self.pool.record_lookup(query, hit)
        return {}

    def _record_load(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        self.pool.record_load([e for held in (s.leases.get(k) for k in wire.hashes(msg, "keys"))
                               if held for e in held[-1:]])  # fmt: skip
        return {}

    def _forget_request(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        self.pool.forget_request(f"{s.engine}/{wfield(msg, 'req_id', str)}")
        return {}

    def _invalidate(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        for key in wire.hashes(msg, "keys"):
            self.pool.invalidate(key)
            s.writing.pop(key, None)
        return {}

    def _apply_report(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        report = codec.report_from_wire(wfield(msg, "report", dict), len(self.config.devices),
                                        self.world_size)  # fmt: skip
        settled = self.pool.apply_report(report)
        for key in settled:
            s.writing.pop(key, None)
        return {"settled": wire.hexes(settled)}

    def _clear(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        self.pool.clear()
        return {}

    def _status(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        return {"status": self.pool.status().to_dict()}


# ----------------------------------------------------------------------------- the socket
def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the peer process (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


class ServiceServer:
    """Accepts connections on ``socket_path`` and runs each on its own thread."""

    def __init__(self, service: PoolService, socket_path: str | os.PathLike) -> None:
        self.service = service
        self.path = Path(socket_path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AlreadyServing(f"a kvpool daemon already serves {self.path}") from None
        self.path.unlink(missing_ok=True)  # a stale socket of a service that died
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # the socket is 0600 from the start, no window
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self._next = 0
        self._stop = threading.Event()
        self._conns: dict[int, socket.socket] = {}

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            self._next += 1
            threading.Thread(target=self._serve, args=(self._next, conn), daemon=True,
                             name=f"kvpool-conn-{self._next}").start()  # fmt: skip

    def _serve(self, sid: int, conn: socket.socket) -> None:
        pid, uid = _peer(conn)
        self._conns[sid] = conn
        try:
            if uid != os.getuid() and uid != 0:
                wire.send(conn, {"ok": False, "error": f"uid {uid} may not use this pool "
                                 f"(the service runs as uid {os.getuid()})"})  # fmt: skip
                return
            self.service.open_session(sid, pid, uid)
            while True:
                try:
                    msg, fds = wire.recv(conn, with_fds=False)
                except EOFError:
                    return
                except WireError as exc:
                    wire.send(conn, {"ok": False, "error": exc.reason})
                    if exc.fatal:
                        return
                    continue
                reply, fds = self.service.handle(sid, msg)
                wire.send(conn, reply, fds)
        except OSError:
            return  # the peer went away mid-message
        finally:
            self._conns.pop(sid, None)
            self.service.close_session(sid)
            conn.close()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for conn in list(self._conns.values()):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)


def run_daemon(config: PoolConfig, socket_path: str | os.PathLike) -> int:
    """``kvpool daemon``: serve until SIGTERM/SIGINT. Exit 0 also when another daemon already
    serves this socket (an engine that raced another to start one)."""
    try:
        server = ServiceServer(PoolService(config), socket_path)
    except AlreadyServing as exc:
        logger.info("%s", exc)
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.shutdown())
    logger.info("kvpool daemon: serving %s (pid %d)", socket_path, os.getpid())
    server.serve_forever()
    return 0
