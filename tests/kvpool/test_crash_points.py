"""Crash consistency of the SSD index at every step of a save, deterministically.

A child process saves rounds of chunks into a pool of two SSDs (io_uring and posix) until the
pool has evicted and reused slots, and SIGKILLs itself at the n-th passage through one fault
point of the save path (wrappers installed in the child only; no timing decides where it dies).
A fresh pool is then opened on the same files and must:

* show no chunk that does not verify: every visible chunk reads back exactly as written, and
  reading all of them invalidates nothing (the index never promises a chunk it does not hold);
* lose no committed chunk whose record was durable and whose slot was not handed to another
  chunk afterwards.

The child logs every planned slot and every committed chunk with ``os.write`` as it goes, so the
log survives the SIGKILL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.local import LocalPool  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCKS, BLOCK = 48, 16  # 12 chunks of 4 blocks (32 KiB) a round; 2 x 64 slots in the pool
LAYOUT = "crash-points"

CHILD = r'''
import json, os, signal, sys
import torch
from vllm_kvpool.handlers.device import DeviceHandler
from vllm_kvpool.local import LocalPool
from vllm_kvpool.pool import UnifiedPool

sys.path.insert(0, {tests!r})
from test_crash_points import BLOCKS, BLOCK, LAYOUT, config, content, hashes_of

point, nth, first_round, fail_device = {point!r}, {nth}, {first_round}, {fail_device!r}
log = os.open({log!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
state = {{"armed": False, "calls": 0, "failed": False}}


def note(**event):
    os.write(log, (json.dumps(event) + "\n").encode())


def die():
    note(event="kill", point=point)
    os.kill(os.getpid(), signal.SIGKILL)


def at(name):
    """A fault point; counted only once the pool has started reusing slots."""
    if name == point and state["armed"]:
        state["calls"] += 1
        if state["calls"] == nth:
            die()


def stale(handler, slots):
    return any(handler._recorded[s] for s in slots)


retire = DeviceHandler.retire
def retire_(self, slots):
    if not stale(self, slots):
        return retire(self, slots)
    state["armed"] = True
    at("before_retire")
    retire(self, slots)
    at("after_retire")
DeviceHandler.retire = retire_

submit_save = DeviceHandler.submit_save
def submit_save_(self, ops):
    if fail_device == self.cfg.name and state["armed"] and not state["failed"]:
        state["failed"] = True  # one failed save: the device is marked failed, then comes back
        raise OSError(f"{{self.name}}: injected write error")
    if point == "torn_data" and state["armed"] and stale(self, [op.slot for op in ops]):
        state["calls"] += 1
        if state["calls"] == nth:  # half of the first chunk's bytes reach the device, then death
            self.retire([op.slot for op in ops])
            op = ops[0]
            half = self.io_length(op.nbytes) // 2 // self.alignment * self.alignment
            self.device.write([(self.offset(op.slot), op.address, half)])
            die()
    return submit_save(self, ops)
DeviceHandler.submit_save = submit_save_

persist = DeviceHandler._persist
def persist_(self, ops, outcomes):
    at("before_sync")  # data written, not yet durable, no record
    return persist(self, ops, outcomes)
DeviceHandler._persist = persist_

write_records = DeviceHandler._write_records
def write_records_(self, records):
    if not any(any(raw) for _, raw in records):  # erasing (retire): not a new record
        return write_records(self, records)
    at("before_record")  # data durable, no record yet
    if point == "torn_record" and state["armed"] and len(records) > 1:
        state["calls"] += 1
        if state["calls"] == nth:  # the first record of the batch written, the rest not
            write_records(self, records[:1])
            die()
    out = write_records(self, records)
    at("after_record")  # record written, the scheduler not yet told
    return out
DeviceHandler._write_records = write_records_

plan_saves = UnifiedPool.plan_saves
def plan_saves_(self, req_id, chunks):
    evictions = self.lookups.evictions
    planned = plan_saves(self, req_id, chunks)
    for p in planned:
        loc = p.entry.location
        note(event="plan", key=p.entry.key.decode(), device=loc.device, slot=loc.slot)
    if self.lookups.evictions > evictions:
        state["armed"] = True
        at("after_evict")  # slots freed and handed out, nothing written yet
    return planned
UnifiedPool.plan_saves = plan_saves_

kv = {{f"l{{i}}": torch.empty(BLOCKS, 2, BLOCK, 32) for i in range(2)}}
with LocalPool(config({tmp!r}), kv, BLOCKS, BLOCK, bandwidths=[2.0, 2.0], layout_id=LAYOUT) as pool:
    for round_ in range(first_round, first_round + 200):
        hashes = hashes_of(round_)
        for k, t in kv.items():
            t.copy_(content(round_, k))
        pool.save(hashes, list(range(BLOCKS)))
        for h in hashes[:: BLOCKS // 12]:
            e = pool.pool.index.get(h)
            if e is not None and e.committed:
                note(event="commit", key=h.decode(), device=e.location.device, slot=e.location.slot)
note(event="end")
'''


def config(tmp: str) -> dict:
    return {"chunk_tokens": 64, "device_retry_seconds": 1e-6, "devices": [
        {"ssd": {"path": f"{tmp}/s0.kvpool", "capacity": "2MiB", "bandwidth_gbps": 2.0}},
        {"ssd": {"path": f"{tmp}/s1.kvpool", "capacity": "2MiB", "backend": "posix",
                 "bandwidth_gbps": 2.0}}]}  # fmt: skip


def hashes_of(round_: int) -> list[bytes]:
    return [f"r{round_}-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]


def content(round_: int, layer: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(round_ * 7 + int(layer[1:]))
    return torch.randn(BLOCKS, 2, BLOCK, 32, generator=g)


def crash(tmp: Path, point: str, nth: int, first_round: int = 0,
          fail_device: str | None = None) -> list[dict]:  # fmt: skip
    """Run the saving child until it kills itself at the fault point; its log's events."""
    log = tmp / "events.jsonl"
    before = log.read_text().count("\n") if log.exists() else 0
    script = CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp), log=str(log),
                          point=point, nth=nth, first_round=first_round,
                          fail_device=fail_device)  # fmt: skip
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    events = [json.loads(x) for x in log.read_text().splitlines()[before:]]
    assert events and events[-1] == {"event": "kill", "point": point}, (
        f"the child did not die at {point} #{nth} (rc {child.returncode}): {child.stderr[-2000:]}")
    assert child.returncode == -9
    return events


def check_after_restart(tmp: Path, events: list[dict]) -> int:
    """Every visible chunk verifies and holds its bytes; every committed chunk whose slot was not
    planned again since is visible. Returns how many chunks are visible."""
    must_survive: dict[tuple[int, int], str] = {}
    for e in events:
        where = (e.get("device"), e.get("slot"))
        if e["event"] == "plan":
            must_survive.pop(where, None)  # its slot went to another chunk: may be gone
        elif e["event"] == "commit":
            must_survive[where] = e["key"]
    kv = {f"l{i}": torch.zeros(BLOCKS, 2, BLOCK, 32) for i in range(2)}
    with LocalPool(config(str(tmp)), kv, BLOCKS, BLOCK, bandwidths=[2.0, 2.0],
                   layout_id=LAYOUT) as pool:  # fmt: skip
        entries = list(pool.pool.index.entries.values())
        visible = {e.key.decode(): (e.location.device, e.location.slot) for e in entries}
        for where, key in must_survive.items():
            assert visible.get(key) == where, f"committed chunk {key} in {where} was lost"
        for e in entries:
            round_, block = (int(x) for x in e.key.rstrip(b".").decode()[1:].split("-"))
            hashes, ids = hashes_of(round_), list(range(BLOCKS))
            lo, hi = block, block + e.location.num_blocks
            for t in kv.values():
                t.zero_()
            # Read exactly this chunk: its own hashes from its first block on.
            result = pool.fetch(hashes[lo:hi], ids[lo:hi])
            assert result.ok and result.blocks == hi - lo, f"visible chunk {e.key!r} does not verify"
            for k in kv:
                assert torch.equal(kv[k][lo:hi], content(round_, k)[lo:hi]), (e.key, k)
        assert pool.pool.lookups.invalidated == 0
        assert pool.status().transfers.devices["ssd0"].corrupt == 0
    return len(entries)


# (fault point, n-th passage once slots are reused): every step of the save path
POINTS = [
    ("after_evict", 2),  # slots freed and re-planned, nothing on the device touched yet
    ("before_retire", 3),  # the old record still there, its data still intact
    ("after_retire", 3),  # the old record erased (durably), the new data not written
    ("torn_data", 2),  # half of the new data written over the old chunk
    ("before_sync", 5),  # new data written, not yet durable, no record
    ("before_record", 5),  # new data durable, no record
    ("torn_record", 2),  # some of a batch's records written
    ("after_record", 5),  # record written, the pool not yet told
]


@pytest.mark.parametrize(("point", "nth"), POINTS, ids=[p for p, _ in POINTS])
def test_crash_at_fault_point(tmp_path, point, nth):
    events = crash(tmp_path, point, nth)
    assert any(e["event"] == "commit" for e in events)
    assert check_after_restart(tmp_path, events) >= 12


def test_crash_after_a_restart_reuses_restored_slots_safely(tmp_path):
    """Restore path: the second life starts on records of the first (every slot counts as
    recorded) and dies while overwriting restored chunks' slots."""
    first = crash(tmp_path, "after_record", 3)
    second = crash(tmp_path, "torn_data", 1, first_round=1000)
    assert check_after_restart(tmp_path, first + second) >= 12


def test_crash_after_a_device_failed_and_came_back(tmp_path):
    """Device-failure path: ssd1 fails one save (its chunks become misses, its slots free),
    comes back, its slots are reused, and the process dies before a new record."""
    events = crash(tmp_path, "before_record", 8, fail_device="ssd1")
    assert check_after_restart(tmp_path, events) >= 12
