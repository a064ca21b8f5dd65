"""The device copy path (``device_copy``) on a fake device: pinned registration of the host
memory loads read from, the per-layer batched copy plan (one copy per contiguous run, or one
staged copy per chunk and one gather), per-layer marks the forward waits on, and the same bytes
as the CPU path for full and partial reads, one KV cache group and several."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_kvpool._kvio")

import vllm_kvpool.engine as engine_mod  # noqa: E402
from tests.kvpool.fake_device import FakeDevice  # noqa: E402
from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.device_copy import Copier, block_runs, copier_for, stage_pays  # noqa: E402
from vllm_kvpool.layout import ChunkKV, ChunkLayout, GroupLayout  # noqa: E402
from vllm_kvpool.layout import build as layouts  # noqa: E402
from vllm_kvpool.local import LocalPool  # noqa: E402
from vllm_kvpool.protocol import ChunkRead, LoadRequest  # noqa: E402

NUM_BLOCKS, HEADS, TOKENS, DIM = 32, 2, 4, 8
PAGE = HEADS * TOKENS * DIM * 4  # float32


def test_block_runs_one_per_contiguous_run():
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert block_runs([7]) == [(0, 7, 1)]


def test_staging_pays_for_short_runs_only_when_it_saves_copies():
    assert stage_pays(6, 2, 6 * PAGE, short_run_bytes=2 * PAGE)  # 6 runs of one page
    assert not stage_pays(6, 2, 6 * PAGE, short_run_bytes=PAGE)  # the runs are not short
    # One run per read: staging would add the gather and save no copy.
    assert not stage_pays(2, 2, 2 * PAGE, short_run_bytes=1 << 40)


def test_cpu_kv_gets_the_host_copier():
    assert type(copier_for(torch.device("cpu"))) is Copier
    assert Copier.kv_addressable


# -- layer copies against the CPU path -------------------------------------------------------
def make_kv(names: list[str], heads: tuple[int, ...] = (HEADS,) * 3) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(NUM_BLOCKS, h, TOKENS, DIM) for n, h in zip(names, heads, strict=True)}


def from_tensors(kv: dict[str, torch.Tensor]) -> ChunkKV:
    """The local pool's layout of these tensors: chunks of 4 blocks."""
    config = load_pool_config({"chunk_tokens": 4 * TOKENS, "devices": [
        {"host": {"capacity": "1MiB"}}]})  # fmt: skip
    return ChunkKV.from_kv_caches(kv, layouts.from_kv_caches(config, kv, NUM_BLOCKS, TOKENS),
                                  NUM_BLOCKS)  # fmt: skip


def single() -> tuple[ChunkKV, dict]:
    kv = make_kv(["l0", "l1", "l2"])
    return from_tensors(kv), kv


def mixed() -> tuple[ChunkKV, dict]:
    """Layers of different page sizes: one group each, the same block table."""
    kv = make_kv(["l0", "l1", "l2"], heads=(2, 1, 3))
    return from_tensors(kv), kv


def hybrid() -> tuple[ChunkKV, dict]:
    kv = make_kv(["f0", "f1", "s0"])
    layout = ChunkLayout((GroupLayout(0, ("f0", "f1"), PAGE, TOKENS),
                          GroupLayout(1, ("s0",), PAGE, TOKENS, window_blocks=2,
                                      sliding_window=2 * TOKENS)), 4)  # fmt: skip
    return ChunkKV.from_kv_caches(kv, layout, NUM_BLOCKS), kv


# (stored blocks, skip / sections, destination ids per section) of two chunks each
LAYOUTS = {"single": single, "mixed": mixed, "hybrid": hybrid}
READS = {
    ("single", "full"): [(4, 0, [[9, 10, 3, 4]]), (4, 0, [[20, 2, 7, 8]])],
    ("single", "partial"): [(4, 1, [[11, 12, 13]]), (3, 2, [[30]])],
    ("mixed", "full"): [(4, 0, [[9, 10, 3, 4]]), (4, 0, [[20, 2, 7, 8]]), (4, 0, [[0, 1, 2, 5]])],
    ("mixed", "partial"): [(4, 3, [[11]]), (4, 1, [[30, 29, 28]])],
    ("hybrid", "full"): [(4, ((0, 4), (0, 2)), [[9, 10, 3, 4], [5, 6]]),
                         (4, ((0, 4), (0, 2)), [[20, 2, 7, 8], [25, 27]])],
    ("hybrid", "partial"): [(4, ((1, 3), (1, 1)), [[11, 12, 13], [14]]),
                            (4, ((2, 2), (0, 0)), [[0, 1], []])],
}  # fmt: skip


def chunk_reads(layout: ChunkKV, spec: list, seed: int) -> list[tuple[ChunkRead, torch.Tensor]]:
    """``spec``: (stored, skip or (skip, count) per section, ids per section or one list that
    every group's section takes)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (stored, skip, ids) in enumerate(spec):
        ids = ids * layout.layout.num_groups if len(ids) == 1 else ids
        sections = skip if isinstance(skip, tuple) else tuple((skip, len(s)) for s in ids)
        flat = tuple(b for s in ids for b in s)
        read = ChunkRead(f"c{i}".encode(), 0, i, stored, {}, flat, sections)
        data = torch.randint(0, 256, (layout.nbytes(stored),), dtype=torch.uint8, generator=g)
        out.append((read, data))
    return out


def runs_of(ids: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False)) if ids else 0


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("extent", ["full", "partial"])
@pytest.mark.parametrize("staged", [False, True])
def test_layer_copies_match_the_cpu_path(kind, extent, staged):
    ref, ref_kv = LAYOUTS[kind]()
    dev, dev_kv = LAYOUTS[kind]()
    spec = READS[(kind, extent)]
    reads = chunk_reads(ref, spec, 0)
    fake = FakeDevice(short_run_bytes=(1 << 40) if staged else 1)
    host, plan = Copier(), fake.prepare(dev, reads)
    for li, layer in enumerate(dev.layers):
        host.load_layer(ref, li, host.prepare(ref, reads))
        fake.clear()
        mark = fake.load_layer(dev, li, plan)
        assert fake.of("record") == [("record", mark)]  # one mark per layer
        gi = dev.where(li)[0]
        ids = [s[2][gi] if kind == "hybrid" else s[2][0] for s in spec]
        runs = sum(runs_of(i) for i in ids)
        sources = sum(bool(i) for i in ids)
        gather = staged and runs > sources + 1
        copies, gathers = fake.of("copy"), fake.of("gather")
        kv_ptr = layer.tensor.untyped_storage().data_ptr()
        if gather:  # one staged copy per chunk, one gather kernel into the KV
            assert len(copies) == sources and all(c[1] != kv_ptr for c in copies)
            assert gathers == [("gather", kv_ptr, sum(map(len, ids)))]
        else:  # one copy per contiguous run, straight into the KV pages
            assert len(copies) == runs and all(c[1] == kv_ptr for c in copies)
            assert gathers == []
    for name in ref_kv:  # raw bytes (random bytes include NaNs)
        assert torch.equal(dev_kv[name].view(torch.int32), ref_kv[name].view(torch.int32)), name
    assert any(t.view(torch.int32).any() for t in dev_kv.values())


# -- the engine on the fake device -----------------------------------------------------------
BLOCKS, BLOCK = 64, 16  # 16 chunks of 4 blocks
HASHES = [f"devcopy-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
IDS = list(range(BLOCKS))


def pool_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BLOCK, 32, generator=g) for i in range(3)}


def pool_config(tmp: Path, verify: bool) -> dict:
    return {"chunk_tokens": 64, "verify_checksums": verify, "staging": "512KiB", "devices": [
        {"host": {"capacity": "256KiB", "bandwidth_gbps": 1.0}},  # 5 chunks of 48 KiB
        {"ssd": {"path": str(tmp / "s0.kvpool"), "capacity": "1MiB", "bandwidth_gbps": 1.0}}]}  # fmt: skip


@pytest.fixture
def fake(monkeypatch) -> FakeDevice:
    device = FakeDevice()
    monkeypatch.setattr(engine_mod, "copier_for", lambda kv_device: device)
    return device


def sync_fetch(pool: LocalPool, skip: int) -> list[str]:
    """A sync load as the connector issues it: the forward waits layer by layer. Returns the
    layer names in order; the first chunk's first ``skip`` blocks are left out."""
    jobs = pool.pool.load_jobs(pool.pool.lookup(HASHES), [IDS], load_from=skip)
    reads = [read for read, _ in jobs]
    eng = pool.engine
    eng.start_loads([LoadRequest("sync", tuple(reads), is_async=False)])
    names = list(eng.layout.index)
    for name in names:
        eng.wait_layer(name)
    eng.wait_sync_loads()
    eng.wait_all()
    assert not eng.take_invalid_blocks()
    return names


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("mode", ["async", "sync", "sync_partial"])
def test_engine_loads_through_the_device_copier(tmp_path, fake, verify, mode):
    kv = pool_kv(0)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(pool_config(tmp_path, verify), kv, BLOCKS, BLOCK) as pool:
        assert pool.engine.copier is fake
        regions = sorted(a for h in pool.handlers for a, _ in h.host_regions())
        assert len(regions) == 2  # the host pool and the SSD's staging buffers
        assert sorted(c[1] for c in fake.of("register")) == regions  # each once
        assert pool.save(HASHES, IDS) == 16
        for t in kv.values():
            t.zero_()
        fake.clear()
        skip = 1 if mode == "sync_partial" else 0
        if mode == "async":
            assert pool.fetch(HASHES, IDS).ok
        else:
            names = sync_fetch(pool, skip)
            marks = [c[1] for c in fake.of("record")]
            assert len(marks) == len(names)  # one per layer, all layers batched
            forward = [c[1] for c in fake.of("wait") if c[2] == "forward"]
            assert forward[: len(names)] == marks  # wait_layer waits for its own layer
        fence = fake.of("fence")
        assert len(fence) == 1 and ("wait", fence[0][1], "side") in fake.calls
        copies = fake.of("copy")
        assert copies and all(pinned for *_, pinned in copies)  # DMA from pinned memory only
        kinds = [c[0] for c in fake.calls]  # every copy done before the batch reports
        last_sync = max(i for i, k in enumerate(kinds) if k == "sync")
        assert not {"copy", "gather"} & set(kinds[last_sync:])
    assert fake.pinned == {}  # unregistered on close
    assert sorted(c[1] for c in fake.of("unregister")) == regions
    for k in kv:
        assert torch.equal(kv[k][skip:], want[k][skip:]), k
        assert not kv[k][:skip].any()  # the skipped blocks were not written


def test_a_restarted_services_new_host_memory_is_pinned_before_loads_copy_from_it(tmp_path,
                                                                                  fake):
    """The pool service restarted: its engines map new shared memory (``adopt``); the copier
    registers it as it did the first mapping, so loads from it are still DMA from pinned
    memory."""
    kv = pool_kv(0)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(pool_config(tmp_path, False), kv, BLOCKS, BLOCK) as pool:
        host = next(h for h in pool.handlers if h.resident)
        fresh = host.io.HostPool(host.pool.capacity, name="restarted")
        fake.clear()
        host.adopt(fresh)  # what the remote pool's re-attach does with the new memfd
        assert ("register", fresh.address) in [c[:2] for c in fake.calls]
        assert pool.save(HASHES, IDS) == 16  # into the new mapping
        for t in kv.values():
            t.zero_()
        fake.clear()
        assert pool.fetch(HASHES, IDS).ok
        copies = fake.of("copy")
        assert copies and all(pinned for *_, pinned in copies)
    for k in kv:
        assert torch.equal(kv[k], want[k]), k


# -- CudaCopier's registration glue (torch's cudart stubbed: no GPU here) -----------------------
class _Cudart:
    def __init__(self, err: int) -> None:
        self.err, self.calls = err, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size, flags))
        return self.err

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("unregister", ptr))
        return 0


@pytest.mark.parametrize("err", [0, 712])  # 712: cudaErrorHostMemoryAlreadyRegistered
def test_cuda_registration_through_torch_cudart(monkeypatch, caplog, err):
    from vllm_kvpool.device_copy import CudaCopier, DeviceCopier

    cudart = _Cudart(err)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    copier = CudaCopier.__new__(CudaCopier)  # no stream: nothing here is copied
    DeviceCopier.__init__(copier)
    copier.register_host(4096, 1 << 20)
    copier.register_host(4096, 1 << 20)  # the same region again: asked of CUDA once at most
    if err:
        assert copier.pinned_bytes == 0 and "stay pageable" in caplog.text
        assert cudart.calls == [("register", 4096, 1 << 20, 0)] * 2  # retried, never recorded
    else:
        assert copier.pinned_bytes == 1 << 20
        assert cudart.calls == [("register", 4096, 1 << 20, 0)]
    monkeypatch.setattr(copier, "_sync", lambda: None)
    copier.close()
    assert copier.pinned_bytes == 0
    assert (("unregister", 4096) in cudart.calls) == (err == 0)  # only what was registered


def test_large_host_memory_is_registered_in_pieces(monkeypatch):
    from vllm_kvpool import device_copy
    from vllm_kvpool.device_copy import CudaCopier, DeviceCopier

    class _Refusing(_Cudart):  # the driver refuses one piece: the others are still pinned
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
            super().cudaHostRegister(ptr, size, flags)
            return 1 if ptr == 4096 + (1 << 20) else 0

    cudart = _Refusing(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(device_copy, "REGISTER_PIECE_BYTES", 1 << 20)
    copier = CudaCopier.__new__(CudaCopier)
    DeviceCopier.__init__(copier)
    copier.register_host(4096, (3 << 20) + 512)  # 3 whole pieces and a tail
    starts = [4096 + (i << 20) for i in range(4)]
    assert cudart.calls == [("register", s, 1 << 20, 0) for s in starts[:3]] + [
        ("register", starts[3], 512, 0)]
    assert copier.pinned_bytes == (2 << 20) + 512  # the refused piece stays pageable
    monkeypatch.setattr(copier, "_sync", lambda: None)
    copier.close()
    assert [c for c in cudart.calls if c[0] == "unregister"] == [
        ("unregister", s) for s in (starts[0], starts[2], starts[3])]
