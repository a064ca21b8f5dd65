"""The fetch path: verify once (host chunks at save, SSD chunks on every read), the host share
copied in one multi-threaded pass, one share of a fetch alone, bytes identical in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.local import LocalPool  # noqa: E402

BLOCKS, BLOCK = 64, 16  # 16 chunks of 4 blocks


def make_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BLOCK, 32, generator=g) for i in range(3)}


def config(tmp: Path, **top) -> dict:
    return {"chunk_tokens": 64, **top, "devices": [
        {"host": {"capacity": "256KiB", "bandwidth_gbps": 1.0}},  # 5 chunks of 48 KiB
        {"ssd": {"path": str(tmp / "s0.kvpool"), "capacity": "1MiB", "bandwidth_gbps": 1.0}}]}


HASHES = [f"fetch-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
IDS = list(range(BLOCKS))


def fetch_all(pool: LocalPool, kv: dict[str, torch.Tensor], **kw):
    for t in kv.values():
        t.zero_()
    return pool.fetch(HASHES, IDS, **kw)


def on(pool: LocalPool, kind: str) -> list:
    devs = {i for i, d in enumerate(pool.config.devices) if d.kind == kind}
    return [e for e in pool.pool.index.entries.values() if e.location.device in devs]


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_bytes_identical_in_every_mode(tmp_path, verify, threads):
    kv = make_kv(0)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(config(tmp_path, verify_checksums=verify, copy_threads=threads), kv, BLOCKS,
                   BLOCK) as pool:  # fmt: skip
        assert pool.engine.loads.copy_threads == threads
        assert pool.save(HASHES, IDS) == 16
        assert on(pool, "host") and on(pool, "ssd")  # both shares present
        r = fetch_all(pool, kv)
        assert r.ok and r.blocks == BLOCKS
        devices = pool.status().transfers.devices
        assert devices["host0"].chunks_read == len(on(pool, "host"))
        assert devices["ssd0"].chunks_read == len(on(pool, "ssd"))
    for k in kv:
        assert torch.equal(kv[k], want[k]), k


def corrupt_host_chunk(pool: LocalPool) -> int:
    e = min(on(pool, "host"), key=lambda e: HASHES.index(e.key))
    pool.handlers[e.location.device].view(e.location.slot, e.location.nbytes)[100] ^= 0xFF
    return HASHES.index(e.key)


def test_host_chunk_verified_at_save_not_on_every_fetch(tmp_path):
    """Default: a host chunk's bytes are trusted after the save (no hash pass on the fetch, as
    LMCache); ``verify_checksums: true`` re-verifies on every fetch and turns a changed chunk
    into a miss (recomputed, never served)."""
    kv = make_kv(1)
    with LocalPool(config(tmp_path), kv, BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        corrupt_host_chunk(pool)
        r = fetch_all(pool, kv)
        assert r.ok and pool.status().transfers.devices["host0"].corrupt == 0
    with LocalPool(config(tmp_path, verify_checksums=True), make_kv(1), BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        first = corrupt_host_chunk(pool)
        r = fetch_all(pool, kv)
        assert not r.ok and pool.status().transfers.devices["host0"].corrupt == 1
        assert HASHES[first] not in pool.pool.index  # dropped: the next lookup misses it


def test_ssd_chunk_verified_on_every_read(tmp_path):
    """With ``verify_checksums`` off, an SSD chunk is still checked on every read, not only the
    first: a chunk altered on the device after it was read once is caught the second time."""
    kv = make_kv(2)
    with LocalPool(config(tmp_path), kv, BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        assert fetch_all(pool, kv).ok
        e = min(on(pool, "ssd"), key=lambda e: HASHES.index(e.key))
        with open(tmp_path / "s0.kvpool", "r+b") as f:
            f.seek(e.location.slot * pool.layout.slot_bytes + 8)
            f.write(b"\x00" * 8)
        r = fetch_all(pool, kv)
        assert not r.ok and pool.status().transfers.devices["ssd0"].corrupt == 1
        assert e.key not in pool.pool.index


def test_one_share_of_a_fetch_alone(tmp_path):
    """``fetch(devices=...)`` reads exactly the prefix's chunks on those devices and leaves the
    other blocks alone: the parts a benchmark's in-run bound is made of."""
    kv = make_kv(3)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(config(tmp_path), kv, BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        ssd = {HASHES.index(e.key) for e in on(pool, "ssd")}
        r = fetch_all(pool, kv, devices={1})
        assert r.ok and r.blocks == 4 * len(ssd)
        for k in kv:
            for c in range(16):
                got = kv[k][4 * c : 4 * c + 4]
                if 4 * c in ssd:
                    assert torch.equal(got, want[k][4 * c : 4 * c + 4])
                else:
                    assert not got.any()  # the host share was not touched
        devices = pool.status().transfers.devices
        assert devices["host0"].chunks_read == 0 and devices["ssd0"].chunks_read == len(ssd)


def test_fetches_are_counted_as_lookups(tmp_path):
    """The local pool's fetches show in its hit rate (the demo plot said 0% over a 1 GiB fetch);
    a share fetched alone is a measurement and counts nothing."""
    kv = make_kv(0)
    with LocalPool(config(tmp_path), kv, BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        fetch_all(pool, kv)
        lookups = pool.status().lookups
        assert (lookups.query_tokens, lookups.hit_tokens, lookups.loads) == (BLOCKS * BLOCK,
                                                                             BLOCKS * BLOCK, 1)  # fmt: skip
        pool.fetch([b"unseen".ljust(32, b".")] * 4, IDS[:4])  # nothing stored: a miss
        fetch_all(pool, kv, devices={0})
        lookups = pool.status().lookups
        assert lookups.hit_rate == pytest.approx(BLOCKS / (BLOCKS + 4))
        assert lookups.loads == 1  # the miss loaded nothing; the share alone is not counted


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_host_share_in_batches_the_loader_helps_with(tmp_path, monkeypatch, copy_threads):
    """The unverified host share goes in batches the copier and, with a core to spare, the
    loader thread take turns on: every byte lands once, and the host device's busy time is
    charged once for the whole share. With SSD reads in the load the copier leaves the loader a
    core (2 cores: one copier thread, whatever ``copy_threads`` says)."""
    from vllm_kvpool.engine import loads

    monkeypatch.setattr(loads, "BULK_BATCH_BYTES", 1)  # one chunk per batch
    monkeypatch.setattr(loads.os, "sched_getaffinity", lambda _: {0, 1})
    takers = []
    real = loads._Bulk.take_one

    def spy(self, path, threads=1):
        took = real(self, path, threads)
        if took:
            name = loads.threading.current_thread().name
            takers.append((name, threads))
            if name != "kvpool-copy":  # leave the copier its turn on a loaded machine too
                loads.time.sleep(0.005)
        return took

    monkeypatch.setattr(loads._Bulk, "take_one", spy)
    kv = make_kv(2)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(config(tmp_path, copy_threads=copy_threads), kv, BLOCKS, BLOCK) as pool:
        pool.save(HASHES, IDS)
        host = len(on(pool, "host"))
        for _ in range(3):
            r = fetch_all(pool, kv)
            assert r.ok and r.blocks == BLOCKS
            for k in kv:
                assert torch.equal(kv[k], want[k]), k
        assert len(takers) == 3 * host  # each chunk copied once per fetch
        assert ("kvpool-copy", 1) in takers and all(t == 1 for _, t in takers)
        assert pool.status().transfers.devices["host0"].chunks_read == 3 * host


@pytest.mark.parametrize("verify", [False, True])
def test_hybrid_host_share_partial_chunks_batched(tmp_path, monkeypatch, verify):
    """With HMA, chunks before the hit position are read without their sliding-window tails
    (the last full chunk keeps one window block, skipping the other): unverified, they go to
    the KV with the whole ones through the batched host copy, not chunk by chunk, and put back
    exactly the full-attention blocks and the window at the hit's end. Verified chunks
    (``verify_checksums``) still go one at a time, each hashed whole."""
    from vllm_kvpool.engine import loads
    from vllm_kvpool.layout import ModelGeometry
    from vllm_kvpool.layout import build as layouts

    geo = ModelGeometry("tiny-hybrid", num_layers=4, num_kv_heads=2, head_dim=8, dtype_bytes=2,
                        sliding_window=32, sliding_layers=2, source="test")  # fmt: skip
    blocks = 5 * 4 + 1  # five whole chunks and a one-block one: the hit ends inside the window
    cfg = {"chunk_tokens": 64, "verify_checksums": verify,
           "devices": [{"host": {"capacity": "1MiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip
    layout = layouts.from_model(load_pool_config(cfg), geo, BLOCK)
    g = torch.Generator().manual_seed(7)
    kv = {name: torch.randn(blocks, grp.page_bytes // 2, generator=g).half()
          for grp in layout.groups for name in grp.layer_names}  # fmt: skip
    want = {k: t.clone() for k, t in kv.items()}
    batched, one_by_one = [], []
    real_init, real_read = loads._Bulk.__init__, loads.LoadPath._read_resident

    def bulk_spy(self, batches):
        real_init(self, batches)
        batched.extend(p.read.sections for p in self.chunks)

    def read_spy(self, p, scatter, threads=1):
        one_by_one.append(p.read.sections)
        real_read(self, p, scatter, threads)

    monkeypatch.setattr(loads._Bulk, "__init__", bulk_spy)
    monkeypatch.setattr(loads.LoadPath, "_read_resident", read_spy)
    hashes, ids = HASHES[:blocks], list(range(blocks))
    with LocalPool(cfg, kv, blocks, BLOCK, layout=layout) as pool:
        assert pool.save(hashes, ids) == 6
        for t in kv.values():
            t.zero_()
        r = pool.fetch(hashes, ids)
        assert r.ok and r.blocks == blocks
        host = pool.status().transfers.devices["host0"]
        assert host.chunks_read == 6
        # the bytes charged to the host pool (its learned rate's numerator): the copy's, not
        # the stored chunks'; a verified chunk is read whole to be hashed
        stored = 5 * layout.nbytes(4) + layout.nbytes(1)
        assert layout.fetch_bytes(blocks) < stored
        assert host.bytes_read == (stored if verify else layout.fetch_bytes(blocks))
    shapes = [((0, 4), (0, 0))] * 4 + [((0, 4), (1, 1)), ((0, 1), (0, 1))]
    assert sorted(one_by_one if verify else batched) == sorted(shapes)
    assert not (batched if verify else one_by_one)
    for name, t in kv.items():
        if name.startswith("full."):
            assert torch.equal(t.view(torch.int16), want[name].view(torch.int16)), name
        else:  # the window (2 blocks) at the hit's end; earlier tails dropped on the fetch
            assert torch.equal(t[-2:].view(torch.int16), want[name][-2:].view(torch.int16))
            assert not t[:-2].view(torch.int16).any(), name
