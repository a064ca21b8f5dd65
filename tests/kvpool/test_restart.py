"""A pool that survives a restart: SSD chunks are found again through their index records,
verified on first read, never served under another layout/model, and a crash mid-save leaves
no visible partial chunk. Host-memory chunks are lost on restart."""

from __future__ import annotations

import dataclasses
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.local import LocalPool  # noqa: E402
from vllm_kvpool.persist import RECORD_ALIGN, ChunkRecord, merge_ranks, record_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCKS, BLOCK = 48, 16  # 4 blocks a chunk (64 tokens), 12 chunks


def record(slot=3, fp=7, seq=1, hashes=(b"a" * 32, b"b" * 32), checksum=99) -> ChunkRecord:
    return ChunkRecord(slot, tuple(hashes), len(hashes), 8192, checksum, fp, seq, 16, 65536)


def test_record_round_trip_and_torn_record():
    size = record_bytes(4)
    raw = record().encode(size)
    assert len(raw) == size and ChunkRecord.decode(raw) == record()
    torn = bytearray(raw)
    torn[40] ^= 1  # a record half written when the process died
    assert ChunkRecord.decode(bytes(torn)) is None
    assert ChunkRecord.decode(bytes(size)) is None  # never written


def test_merge_keeps_matching_chunks_every_rank_has():
    rank0 = [record(slot=0), record(slot=1, fp=8), record(slot=2, hashes=(b"c" * 32,)),
             record(slot=5, hashes=(b"a" * 32,), seq=0)]  # fmt: skip
    rank1 = [record(slot=0, checksum=5), record(slot=1, fp=8), record(slot=5, hashes=(b"a" * 32,))]
    chunks = merge_ranks([rank0, rank1], fingerprint=7, num_slots=16, slot_bytes=65536,
                         blocks_per_chunk=4)  # fmt: skip
    # slot 1: another fingerprint; slot 2: rank 1 has no record; slot 5: a shorter copy of the
    # same key (the prompt's partial chunk): the full one in slot 0 wins
    assert [(c.slot, c.checksums) for c in chunks] == [(0, {0: 99, 1: 5})]


def make_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BLOCK, 32, generator=g) for i in range(2)}


def ssd_config(tmp_path: Path, host: bool = False) -> dict:
    devices = [{"ssd": {"path": str(tmp_path / "s0.kvpool"), "capacity": "2MiB",
                        "bandwidth_gbps": 2.0}},
               {"ssd": {"path": str(tmp_path / "s1.kvpool"), "capacity": "2MiB",
                        "backend": "posix", "bandwidth_gbps": 2.0}}]  # fmt: skip
    if host:
        devices.append({"host": {"capacity": "1MiB", "bandwidth_gbps": 1.0}})
    return {"chunk_tokens": 64, "devices": devices}


HASHES = [f"restart-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]


def test_save_stop_start_hit_byte_identical(tmp_path):
    kv = make_kv(0)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(ssd_config(tmp_path, host=True), kv, BLOCKS, BLOCK, layout_id="t") as pool:
        assert pool.save(HASHES, list(range(BLOCKS))) == 12
        on_host = {e.key for e in pool.pool.index.entries.values() if e.location.device == 2}
    assert on_host  # the host pool held some chunks: those are gone after the restart
    fresh = make_kv(1)
    with LocalPool(ssd_config(tmp_path, host=True), fresh, BLOCKS, BLOCK, layout_id="t") as pool:
        restored = pool.pool.index.entries
        assert len(restored) == 12 - len(on_host) and not set(restored) & on_host
        assert all(e.restored and not e.validated for e in restored.values())
        result = pool.fetch(HASHES, list(range(BLOCKS)))
        first_host = min(HASHES.index(k) for k in on_host)
        assert result.ok and result.blocks == first_host > 0  # the prefix up to a lost chunk
        assert all(e.validated for e in restored.values() if HASHES.index(e.key) < first_host)
    for k in kv:
        assert torch.equal(fresh[k][:first_host], want[k][:first_host]), k


def test_other_layout_is_a_miss_and_a_stale_record_is_caught(tmp_path):
    kv = make_kv(0)
    with LocalPool(ssd_config(tmp_path), kv, BLOCKS, BLOCK, layout_id="model-a") as pool:
        pool.save(HASHES, list(range(BLOCKS)))
    with LocalPool(ssd_config(tmp_path), make_kv(1), BLOCKS, BLOCK, layout_id="model-b") as pool:
        assert len(pool.pool.index) == 0  # another model's chunks: ignored, slots free
        assert pool.fetch(HASHES, list(range(BLOCKS))).blocks == 0
    # A record whose slot holds other bytes (slot reused, crash before the new record): the
    # first read of the restored chunk fails its checksum, the chunk is dropped, never served.
    with open(tmp_path / "s0.kvpool", "r+b") as f:
        f.write(bytes(4096))
    fresh = make_kv(2)
    with LocalPool(ssd_config(tmp_path), fresh, BLOCKS, BLOCK, layout_id="model-a") as pool:
        pool.engine.loads.verify = False  # verify_checksums off: restored chunks are verified anyway
        result = pool.fetch(HASHES, list(range(BLOCKS)))
        assert not result.ok and pool.pool.lookups.invalidated >= 1
        assert pool.pool.transfers.devices["ssd0"].corrupt >= 1


def as_written_by_the_xxh64_build(path: Path, size: int) -> int:
    """Rewrite each intact record of an SSD file as the build that checksummed with XXH64 wrote
    it (the chunk's checksum and the record's own); the number of records rewritten."""
    raw = bytearray(path.read_bytes())
    rewritten = 0
    for off in range(0, len(raw) - size + 1, RECORD_ALIGN):
        rec = ChunkRecord.decode(bytes(raw[off : off + size]))
        if rec is None:
            continue
        data = bytes(raw[rec.slot * rec.slot_bytes :][: rec.nbytes])  # the data region starts at 0
        old_rec = dataclasses.replace(rec, checksum=xxhash.xxh64_intdigest(data))
        old = bytearray(old_rec.encode(size))
        struct.pack_into("<Q", old, 12, 0)
        struct.pack_into("<Q", old, 12, xxhash.xxh64_intdigest(bytes(old)))
        raw[off : off + size] = old
        rewritten += 1
    path.write_bytes(raw)
    return rewritten


def test_records_of_the_xxh64_build_are_not_restored(tmp_path):
    """After the switch to XXH3 a record an older build wrote fails its own checksum, so its chunk
    is never restored (rather than restored and caught on its first read)."""
    with LocalPool(ssd_config(tmp_path), make_kv(0), BLOCKS, BLOCK, layout_id="t") as pool:
        assert pool.save(HASHES, list(range(BLOCKS))) == 12
    size = record_bytes(4)
    assert sum(as_written_by_the_xxh64_build(tmp_path / f"s{i}.kvpool", size) for i in (0, 1)) == 12
    with LocalPool(ssd_config(tmp_path), make_kv(1), BLOCKS, BLOCK, layout_id="t") as pool:
        assert len(pool.pool.index) == 0  # nothing restored: every slot free again
        assert pool.fetch(HASHES, list(range(BLOCKS))).blocks == 0


CHILD = """
import sys, time, torch
from vllm_kvpool.local import LocalPool
sys.path.insert(0, {tests!r})
from test_restart import BLOCKS, BLOCK, ssd_config, content
from pathlib import Path
kv = {{f"l{{i}}": torch.empty(BLOCKS, 2, BLOCK, 32) for i in range(2)}}
with LocalPool(ssd_config(Path({tmp!r})), kv, BLOCKS, BLOCK, layout_id="crash") as pool:
    for round in range(10_000):
        hashes = [f"r{{round}}-{{i}}".encode().ljust(32, b".") for i in range(BLOCKS)]
        for k, t in kv.items():
            t.copy_(content(round, k))
        n = pool.save(hashes, list(range(BLOCKS)))
        print(round, n, flush=True)
"""


def content(round_: int, layer: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(round_ * 7 + int(layer[1:]))
    return torch.randn(BLOCKS, 2, BLOCK, 32, generator=g)


def test_sigkill_mid_save_leaves_no_visible_partial_chunk(tmp_path):
    """A process saving continuously is killed with SIGKILL; afterwards every chunk the index
    shows reads back complete and exactly as written (records follow durable data)."""
    script = CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)  # fmt: skip
    committed = 0
    try:
        # 128 slots in all: past 160 chunks the pool has evicted and reused slots. No deadline:
        # a slow machine only takes longer (pytest's timeout bounds a hung child).
        while committed < 160:
            line = child.stdout.readline()
            if not line:
                break
            committed += int(line.split()[1])
        time.sleep(0.05)  # somewhere mid-save (it saves without pause); fault points: test_crash_points
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert committed >= 160, "the saving process did not get going"
    kv = {f"l{i}": torch.zeros(BLOCKS, 2, BLOCK, 32) for i in range(2)}
    with LocalPool(ssd_config(tmp_path), kv, BLOCKS, BLOCK, layout_id="crash") as pool:
        entries = list(pool.pool.index.entries.values())
        assert len(entries) >= 12  # at least the last complete round survives
        checked = 0
        for e in entries:
            round_, block = (int(x) for x in e.key.rstrip(b".").decode()[1:].split("-"))
            hashes = [f"r{round_}-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
            ids = list(range(BLOCKS))
            for t in kv.values():
                t.zero_()
            hits = pool.pool.match(hashes)
            result = pool.fetch(hashes, ids)
            assert result.ok, f"visible chunk {e.key!r} does not verify"
            for h in hits:
                lo, hi = h.first_block, h.first_block + h.num_blocks
                for k in kv:
                    assert torch.equal(kv[k][lo:hi], content(round_, k)[lo:hi])
            checked += 1
        assert checked == len(entries) and pool.pool.lookups.invalidated == 0


def test_restart_through_the_connector(tmp_path):
    """vLLM's real scheduler + worker connector: save, shut down, build a new engine on the
    same files: the SSD chunks of the prefix are hit and land byte-identical; an engine of
    another model over the same files gets no hit."""
    pytest.importorskip("vllm")
    from support.model import write_tiny_llama
    from support.vllm_harness import Harness, make_vllm_config
    from tests.kvpool.test_connector import expected, run_and_capture

    prompt = list(range(3, 3 + 640))  # 20 blocks of 32 tokens = 10 chunks
    # SSDs weigh more than the host pool: the prefix starts on them (smooth weighted round
    # robin), so it survives up to the first chunk that was in host memory.
    pool = {"chunk_tokens": 64, "devices": [
        {"ssd": {"path": str(tmp_path / "ssd0.bin"), "capacity": "4MiB", "bandwidth_gbps": 2.0}},
        {"ssd": {"path": str(tmp_path / "ssd1.bin"), "capacity": "4MiB", "bandwidth_gbps": 2.0}},
        {"host": {"capacity": "512KiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip
    model = write_tiny_llama(tmp_path / "model-a")

    def engine(model_dir: Path) -> Harness:
        return Harness.build(make_vllm_config(model_dir, pool), num_blocks=128)

    h = engine(model)
    h.add("A", prompt + [900])
    h.run(["A"])
    h.drain()
    assert sum(e.committed for e in h.connector.pool.index.entries.values()) == 10
    h.worker.shutdown()

    h = engine(model)
    pool_after = h.connector.pool
    assert pool_after.lookups.restored >= 2
    probe = Harness.make_request("probe", prompt + [5])
    matched, _ = h.connector.get_num_new_matched_tokens(probe, 0)
    assert matched >= 4 * 32  # ssd0, ssd1 chunks lead the prefix
    n_blocks = matched // 32
    got, _ = run_and_capture(h, "B", prompt + [5], n_blocks)
    want = expected(h, prompt + [5], n_blocks)
    for name in h.kv:
        assert torch.equal(got[name], want[name]), name
    assert pool_after.lookups.restored_hits >= 2 and pool_after.lookups.invalidated == 0
    h.worker.shutdown()

    other = engine(write_tiny_llama(tmp_path / "model-b"))  # same shapes, another model
    assert other.connector.pool.lookups.restored == 0
    assert other.connector.get_num_new_matched_tokens(probe, 0) == (0, False)
    other.worker.shutdown()
