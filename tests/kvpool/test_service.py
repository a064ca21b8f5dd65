"""The per-node pool service with real processes and real sockets: a shared host pool's memfd
passed by SCM_RIGHTS, two engines sharing prefix hits through one ``kvpool daemon``, leases
across engines and what a killed engine leaves, a daemon restart, the fingerprint check, the
socket's modes and a fuzzed protocol that never corrupts the index."""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import struct
import threading
import time

import pytest

kvio = pytest.importorskip("vllm_kvpool._kvio")

from support.kvpool_node import (  # noqa: E402
    Daemon,
    EngineProcess,
    block_hashes,
    daemon_connections,
    daemon_pids,
    pool_config,
    stop_daemons,
    wait_until,
)
from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.layout import ChunkLayout, GroupLayout  # noqa: E402
from vllm_kvpool.protocol import WorkerReport  # noqa: E402
from vllm_kvpool.service import codec, wire  # noqa: E402
from vllm_kvpool.service.daemon import AlreadyServing, PoolService, ServiceServer  # noqa: E402
from vllm_kvpool.service.remote import RemotePool  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def node(tmp_path):
    """(workdir, socket path, started daemons, started engines); everything stopped after."""
    sock = tmp_path / "run" / "pool.sock"
    daemons: list[Daemon] = []
    engines: list[EngineProcess] = []
    yield tmp_path, sock, daemons, engines
    for e in engines:
        if e.proc.poll() is None:
            e.kill()
    for d in daemons:
        d.stop()


def start(tmp_path, sock, daemons, **kw) -> dict:
    cfg = pool_config(tmp_path, sock, **kw)
    daemons.append(Daemon(cfg, sock, tmp_path / f"daemon{len(daemons)}.log"))
    return cfg


def start_two_engines(cfg: dict, tmp_path, sock, engines: list) -> tuple[EngineProcess, EngineProcess, int]:
    """Engines a and b on the daemon, and how many connections a holds there."""
    a = EngineProcess(cfg, tmp_path / "a.log")
    engines.append(a)
    a_holds = daemon_connections(sock)
    b = EngineProcess(cfg, tmp_path / "b.log")
    engines.append(b)
    return a, b, a_holds


def kill_and_await_detach(a: EngineProcess, a_holds: int, sock) -> None:
    """SIGKILL ``a``, then wait until the daemon has closed a's connections: it drops a
    session's leases and unsettled writes on that connection's thread once it reads the EOF,
    and the other engine's next request may reach it first (a loaded machine's scheduler
    decides)."""
    left = daemon_connections(sock) - a_holds
    a.kill()
    wait_until(lambda: daemon_connections(sock) == left, "the daemon dropped the killed engine")


# -- the shared host pool -------------------------------------------------------------------
def test_shared_host_pool_passes_by_scm_rights_and_is_written_in_place(tmp_path):
    pool = kvio.HostPool(2 << 20, shared=True, name="shared")
    assert pool.shared and pool.fd >= 0
    assert stat.S_IMODE(os.fstat(pool.fd).st_mode) == 0o600
    memoryview(pool)[:4] = b"kvp!"
    a, b = socket.socketpair()
    child = os.fork()
    if child == 0:  # another process: receives the fd, maps it, writes into it in place
        try:
            msg, fds = wire.recv(b, with_fds=True)
            mine = kvio.HostPool.attach(fds[0], msg["capacity"])
            ok = bytes(memoryview(mine)[:4]) == b"kvp!"  # attaching wrote nothing
            memoryview(mine)[4096:4100] = b"back"
            wire.send(b, {"ok": ok})
        finally:
            os._exit(0)
    wire.send(a, {"capacity": pool.capacity}, [pool.fd])
    reply, _ = wire.recv(a)
    os.waitpid(child, 0)
    assert reply["ok"]
    assert bytes(memoryview(pool)[4096:4100]) == b"back"
    with pytest.raises(ValueError, match="not a shared pool"):
        kvio.HostPool.attach(pool.fd, pool.capacity * 2)


# -- engines through the daemon -------------------------------------------------------------
def test_two_engines_share_prefix_hits_through_the_daemon(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    a = EngineProcess(cfg, tmp_path / "a.log")
    engines.append(a)
    b = EngineProcess(cfg, tmp_path / "b.log")
    engines.append(b)
    assert a.call("save", seq=1, blocks=12)["committed"] == 6  # 6 chunks over host + SSD
    got = b.call("fetch", seq=1, blocks=12)  # b never saved: every hit is a's chunk
    assert got == {**got, "hit_blocks": 12, "ok": True, "wrong_bytes": 0}
    assert b.call("fetch", seq=2, blocks=12)["hit_blocks"] == 0
    status = b.call("status")
    used = {u["name"]: u["used_slots"] for u in status["usage"]}
    assert used["host0"] > 0 and used["ssd0"] > 0, used  # both media served the hit


def test_leases_hold_across_engines_and_drop_with_a_killed_engine(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons, host="128KiB", ssd="")  # 4 slots of 32 KiB
    a, b, a_holds = start_two_engines(cfg, tmp_path, sock, engines)
    assert a.call("save", seq=1, blocks=8)["committed"] == 4  # the pool is full
    assert a.call("pin", seq=1, blocks=8)["pinned"] == 4  # a load of a's is in flight
    assert b.call("save", seq=2, blocks=8)["committed"] == 0  # nothing may be evicted
    got = b.call("fetch", seq=1, blocks=8)
    assert got["hit_blocks"] == 8 and got["wrong_bytes"] == 0, got
    kill_and_await_detach(a, a_holds, sock)  # kill -9: the daemon sees the socket close, a's leases drop
    assert b.call("save", seq=2, blocks=8)["committed"] == 4  # evicts what a held
    assert b.call("fetch", seq=2, blocks=8)["wrong_bytes"] == 0


def test_engine_killed_mid_save_leaves_the_other_serving_correct_bytes(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons, host="256KiB", ssd="")  # 8 slots
    a, b, a_holds = start_two_engines(cfg, tmp_path, sock, engines)
    assert b.call("save", seq=7, blocks=4)["committed"] == 2
    # a reserves 4 slots for a prefix, writes half of each chunk, and is killed
    assert a.call("plan", seq=1, blocks=8, scribble=True)["planned"] == 4
    assert b.call("fetch", seq=1, blocks=8)["hit_blocks"] == 0  # never visible uncommitted
    kill_and_await_detach(a, a_holds, sock)
    assert b.call("fetch", seq=1, blocks=8)["hit_blocks"] == 0
    # the slots a reserved are free again once a is gone: b fills the whole pool
    assert b.call("save", seq=1, blocks=12)["committed"] == 6
    for seq, blocks in ((1, 12), (7, 4)):
        got = b.call("fetch", seq=seq, blocks=blocks)
        assert got["hit_blocks"] == blocks and got["wrong_bytes"] == 0 and got["ok"], got


def test_daemon_restart_recovers_ssd_chunks_and_engines_reattach(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons, host="", ssd="2MiB")
    a = EngineProcess(cfg, tmp_path / "a.log")
    engines.append(a)
    assert a.call("save", seq=3, blocks=10)["committed"] == 5
    daemons[0].stop(9)  # the daemon dies; a keeps running
    start(tmp_path, sock, daemons, host="", ssd="2MiB")
    got = a.call("fetch", seq=3, blocks=10)  # a re-attaches; the chunks come off the SSD
    assert got["hit_blocks"] == 10 and got["wrong_bytes"] == 0 and got["ok"], got
    assert a.call("status")["lookups"]["restored"] == 5


def test_daemon_restart_remaps_host_memory(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons, ssd="")
    a = EngineProcess(cfg, tmp_path / "a.log")
    engines.append(a)
    assert a.call("save", seq=1, blocks=4)["committed"] == 2
    daemons[0].stop()
    start(tmp_path, sock, daemons, ssd="")
    assert a.call("fetch", seq=1, blocks=4)["hit_blocks"] == 0  # host chunks died with it
    assert a.call("save", seq=1, blocks=4)["committed"] == 2  # into the new daemon's memory
    b = EngineProcess(cfg, tmp_path / "b.log")
    engines.append(b)
    got = b.call("fetch", seq=1, blocks=4)  # another engine reads what a wrote after re-attach
    assert got["hit_blocks"] == 4 and got["wrong_bytes"] == 0, got


def test_an_engine_of_another_layout_is_refused_with_the_reason(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons)
    engines.append(EngineProcess(cfg, tmp_path / "a.log"))
    other = load_pool_config(cfg)
    layout = ChunkLayout((GroupLayout(0, ("x",), 4096, 16),), 2, layout_version=12345)
    with pytest.raises(Exception, match="refused this engine: layout fingerprint 0x3039 differs"):
        RemotePool(other, layout, 1, "other-model")


def test_the_first_engine_starts_the_daemon_and_racing_engines_share_one(tmp_path):
    sock = tmp_path / "run" / "pool.sock"
    cfg = pool_config(tmp_path, sock, autostart=True)
    engines = [EngineProcess(cfg, tmp_path / f"e{i}.log", wait=False) for i in range(2)]
    try:
        for e in engines:
            e.attached()
        assert engines[0].call("save", seq=1, blocks=4)["committed"] == 2
        assert engines[1].call("fetch", seq=1, blocks=4)["hit_blocks"] == 4
        assert len(daemon_pids(sock)) == 1
    finally:
        for e in engines:
            e.stop()
        stop_daemons(sock)


def test_engines_racing_to_autostart_spawn_one_daemon(tmp_path, monkeypatch):
    """Three engines find no daemon at the same instant: they take turns on the start lock and
    only the first spawns one (the others find it answering), however slowly it starts."""
    import vllm_kvpool.service.remote as remote

    sock = tmp_path / "run" / "pool.sock"
    cfg = load_pool_config(pool_config(tmp_path, sock, autostart=True))
    layout = ChunkLayout((GroupLayout(0, ("x",), 4096, 16),), 2, layout_version=1)
    spawned, real_start = [], remote.start_daemon

    def slow_start(config, socket_path):
        spawned.append(socket_path)
        time.sleep(0.5)  # a loaded node: every racer has dialled and found nothing by now
        return real_start(config, socket_path)

    monkeypatch.setattr(remote, "start_daemon", slow_start)
    gate, pools, errors = threading.Barrier(3), [], []

    def engine(i: int) -> None:
        gate.wait()
        try:
            pools.append(RemotePool(cfg, layout, 1, "model"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(pools) == 3
        assert spawned == [str(sock)]
        assert len(daemon_pids(sock)) == 1
    finally:
        for p in pools:
            p.close()
        stop_daemons(sock)


# -- the protocol ----------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    """A PoolService on a real socket in this process (its index inspectable)."""
    cfg = load_pool_config({"chunk_tokens": 32, "devices": [
        {"host": {"capacity": "256KiB", "bandwidth_gbps": 1.0}}]})  # fmt: skip
    service = PoolService(cfg)
    server = ServiceServer(service, tmp_path / "s" / "pool.sock")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield service, server
    server.shutdown()


def _raw(server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(server.path))
    s.settimeout(10)
    return s


LAYOUT = ChunkLayout((GroupLayout(0, ("l0",), 8192, 16),), 2, layout_version=77)


def _attach(s: socket.socket, role: str = "scheduler", engine: str = "e") -> dict:
    wire.send(s, {"op": "attach", "role": role, "engine": engine, "rank": 0, "world_size": 1,
                  "layout": codec.layout_to_wire(LAYOUT)})  # fmt: skip
    return wire.recv(s, with_fds=True)[0]


def _index_state(service: PoolService) -> list:
    assert service.pool is not None
    return [(e.key, e.block_hashes, e.location, e.committed, e.readers, dict(e.checksums))
            for e in service.pool.index.oldest_first()] + [
        [a.num_free for a in service.pool.slots]]  # fmt: skip


def test_a_second_daemon_on_the_same_socket_refuses_to_start(served):
    service, server = served
    with pytest.raises(AlreadyServing):
        ServiceServer(PoolService(service.config), server.path)


def test_fuzzed_messages_get_errors_and_never_touch_the_index(served):
    service, server = served
    good = _raw(server)
    assert _attach(good)["ok"]
    hs = block_hashes(1, 6)
    wire.send(good, {"op": "plan_saves", "req_id": "r", "chunks": [
        {"first": f, "hashes": wire.hexes(hs[f:f + 2])} for f in (0, 2, 4)]})  # fmt: skip
    planned = wire.recv(good)[0]["planned"]
    report = {"committed": [[p["entry"]["key"], 0, 99] for p in planned], "failed_saves": [],
              "corrupt": [], "failed_devices": [], "recovered_devices": [], "observations": [],
              "counters": {"devices": {}, "fetch_seconds": []}}  # fmt: skip
    wire.send(good, {"op": "apply_report", "report": report})
    assert wire.recv(good)[0]["ok"]
    before = _index_state(service)
    rng = random.Random(43)
    header = wire.HEADER
    framing = [  # each breaks the stream: an error, then the connection closes
        b"GARBAGE!" * 3,
        header.pack(b"KVPS", 9, 0, 2) + b"{}",
        header.pack(b"KVPS", 1, 0, wire.MAX_MESSAGE + 1),
        header.pack(b"KVPS", 1, 0, 100) + b'{"op": "look',  # truncated body
        header.pack(b"KVPS", 1, 0, 8)[:7],  # truncated header
    ]
    for frame in framing:
        s = _raw(server)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        msg, _ = wire.recv(s)
        assert msg["ok"] is False and msg["error"], frame
        try:
            assert s.recv(1) == b""  # closed by the service
        except ConnectionResetError:
            pass  # closed with the frame's rest unread
        s.close()
    bad_bodies = [b"not json", b"[1, 2]", b'"op"', b"\xff\xfe", b'{"op": 5}',
                  b'{"op": "nope"}', b'{"op": "lookup"}', b'{"op": "lookup", "hashes": "ab"}',
                  b'{"op": "lookup", "hashes": ["zz"]}', b'{"op": "pin", "keys": ["00"]}',
                  b'{"op": "plan_saves", "req_id": "r", "chunks": [{"first": -1}]}',
                  b'{"op": "plan_saves", "req_id": "r", "chunks": [{"first": 0, "hashes": '
                  + json.dumps(wire.hexes(block_hashes(9, 3))).encode() + b"}]}",
                  b'{"op": "apply_report", "report": {"committed": [["00", 5, 1]]}}',
                  b'{"op": "apply_report", "report": {"committed": [], "failed_saves": [], '
                  b'"corrupt": [], "failed_devices": [[7, "x"]], "recovered_devices": [], '
                  b'"observations": [], "counters": {}}}',
                  b'{"op": "record_lookup", "query_tokens": 1, "hit_tokens": 5}',
                  b'{"op": "attach", "role": "scheduler"}']  # fmt: skip
    for _ in range(200):  # random well-framed junk
        bad_bodies.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        fields = {"op": rng.choice(["lookup", "plan_saves", "pin", "unpin", "apply_report",
                                    "invalidate", "record_load", "is_stored"]),
                  rng.choice(["hashes", "keys", "chunks", "report", "req_id"]):
                  rng.choice([None, 1, -3, "x", [None], [[1, 2]], {"a": 1}, ["0" * 300]])}  # fmt: skip
        bad_bodies.append(json.dumps(fields).encode())
    for body in bad_bodies:
        good.sendall(header.pack(b"KVPS", 1, 0, len(body)) + body)
        msg, _ = wire.recv(good)
        assert msg["ok"] is False and msg["error"], body
    assert _index_state(service) == before
    wire.send(good, {"op": "lookup", "hashes": wire.hexes(hs)})
    hits = codec.hits_from_wire(wire.recv(good)[0]["hits"])
    assert [h.num_blocks for h in hits] == [2, 2, 2]  # still serving, index intact


def test_a_peer_of_another_uid_is_refused(served, monkeypatch):
    service, server = served
    import vllm_kvpool.service.daemon as daemon

    real = daemon._peer
    monkeypatch.setattr(daemon, "_peer", lambda conn: (real(conn)[0], 4242))
    s = _raw(server)
    msg, _ = wire.recv(s)
    assert msg["ok"] is False and "uid 4242 may not use this pool" in msg["error"]
    assert struct.calcsize("3i") == 12


def test_a_lookup_holds_its_hits_until_the_load_pins_them(served):
    service, server = served
    cfg = load_pool_config({**service.config.to_dict(),
                            "service": {"socket": str(server.path), "autostart": False}})
    a, b = RemotePool(cfg, LAYOUT, 1, "a"), RemotePool(cfg, LAYOUT, 1, "b")
    slots = service.pool.slots[0].total if service.pool else 0
    hs = block_hashes(1, 2 * slots)

    def fill(pool: RemotePool, hashes: list[bytes]) -> int:
        planned = pool.plan_saves("r", [(f, hashes[f:f + 2]) for f in range(0, len(hashes), 2)])
        report = WorkerReport(committed=[(p.entry.key, 0, 1) for p in planned])
        pool.apply_report(report)
        return len(planned)

    assert fill(a, hs) == slots  # the pool is full
    hits = a.lookup(hs[:4])  # a request of a's matched two chunks...
    assert len(hits) == 2
    assert fill(b, block_hashes(2, 2 * slots)) == slots - 2  # ...b's saves evict all but them
    a.pin([h.entry for h in hits])  # the load's pin finds them where the lookup saw them
    assert [h.entry.location for h in a.lookup(hs[:4])] == [h.entry.location for h in hits]
    a.close()
    b.close()


def test_a_lookup_says_when_another_engines_save_would_extend_it(served):
    service, server = served
    cfg = load_pool_config({**service.config.to_dict(),
                            "service": {"socket": str(server.path), "autostart": False}})
    a, b = RemotePool(cfg, LAYOUT, 1, "a"), RemotePool(cfg, LAYOUT, 1, "b")
    hs = block_hashes(3, 4)
    planned = a.plan_saves("r", [(0, hs[:2]), (2, hs[2:])])
    a.apply_report(WorkerReport(committed=[(planned[0].entry.key, 0, 1)]))
    hits, pending = b.lookup_pending(hs)  # chunk 1 is still being written by a
    assert [h.first_block for h in hits] == [0] and pending == 4
    a.apply_report(WorkerReport(committed=[(planned[1].entry.key, 0, 1)]))
    assert b.lookup_pending(hs)[1] == 0 and len(b.lookup(hs)) == 2
    a.close()
    b.close()


def test_the_service_field_is_one_config_field_away_and_checked():
    base = {"devices": [{"host": {"capacity": "1MiB"}}]}
    assert load_pool_config(base).service is None  # in process: the default
    on = load_pool_config({**base, "service": True})
    assert on.service is not None and on.service.socket.endswith("pool.sock")
    assert load_pool_config(on.to_dict()) == on
    with pytest.raises(ValueError, match="service.sock: unknown field"):
        load_pool_config({**base, "service": {"sock": "/x"}})
    with pytest.raises(ValueError, match="service.socket: expected a Unix socket path"):
        load_pool_config({**base, "service": {"socket": "/" + "x" * 200}})
    with pytest.raises(ValueError, match="service.start_timeout"):
        load_pool_config({**base, "service": {"start_timeout": -1}})


def test_an_engine_serves_on_while_the_daemon_is_down_and_reattaches(node):
    tmp_path, sock, daemons, engines = node
    cfg = start(tmp_path, sock, daemons, host="", ssd="2MiB")
    a = EngineProcess(cfg, tmp_path / "a.log")
    engines.append(a)
    assert a.call("save", seq=3, blocks=4)["committed"] == 2
    daemons[0].stop(9)
    down = a.call("fetch", seq=3, blocks=4)  # no daemon: a miss, not an error
    assert down["hit_blocks"] == 0 and down["ok"]
    assert a.call("save", seq=4, blocks=4)["committed"] == 0  # nothing saved meanwhile
    start(tmp_path, sock, daemons, host="", ssd="2MiB")
    time.sleep(1.1)  # the engine dials a down service again once a second
    got = a.call("fetch", seq=3, blocks=4)  # back: the SSD chunks restored, a re-attached
    assert got["hit_blocks"] == 4 and got["wrong_bytes"] == 0, got
