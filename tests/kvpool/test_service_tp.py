"""Tensor parallelism over the pool service, two real rank processes (vLLM's worker-side role,
``PoolWorker``) and the scheduler side here (``RemotePool``): an MLA layout (the same latents on
every rank) is stored once, by rank 0, and loaded by both ranks byte for byte, in 1/TP of the
bytes a per-rank layout takes; a GQA layout keeps one shard per rank."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.kvpool_node import (  # noqa: E402
    BLOCK_SIZE,
    LAYERS,
    PAGE_SHAPE,
    Daemon,
    EngineProcess,
    block_hashes,
    pool_config,
)
from vllm_kvpool.config import load_pool_config  # noqa: E402
from vllm_kvpool.connector_meta import PoolStepMetadata  # noqa: E402
from vllm_kvpool.layout import ChunkLayout, GroupLayout  # noqa: E402
from vllm_kvpool.protocol import LoadRequest, WorkerReport  # noqa: E402
from vllm_kvpool.service import codec  # noqa: E402
from vllm_kvpool.service.remote import RemotePool  # noqa: E402

pytestmark = pytest.mark.slow
TP = 2
PAGE = 4 * PAGE_SHAPE[0] * PAGE_SHAPE[1] * PAGE_SHAPE[2] * PAGE_SHAPE[3]


def start_tp(tmp_path, replicated: bool) -> tuple[Daemon, dict, ChunkLayout, list]:
    """A daemon and TP rank processes (not waited for: both layouts' ranks start together)."""
    tmp_path.mkdir()
    sock = tmp_path / "run" / "pool.sock"
    cfg = pool_config(tmp_path, sock)
    daemon = Daemon(cfg, sock, tmp_path / "daemon.log")
    layout = ChunkLayout((GroupLayout(0, tuple(f"layer{i}" for i in range(LAYERS)), PAGE,
                                      BLOCK_SIZE),), 2, layout_version=4343, replicated=replicated)  # fmt: skip
    ranks = [EngineProcess(cfg, tmp_path / f"rank{r}.log", wait=False,
                           rank=(codec.layout_to_wire(layout), r, TP)) for r in range(TP)]  # fmt: skip
    return daemon, cfg, layout, ranks


def run_tp(daemon: Daemon, cfg: dict, layout: ChunkLayout, ranks: list) -> tuple[list, int, list]:
    """Save 12 blocks through the TP ranks, load them back on both: (wrong bytes per rank,
    stored bytes, chunks each rank committed)."""
    try:
        for r in ranks:
            r.attached()
        pool = RemotePool(load_pool_config(cfg), layout, 1 if layout.replicated else TP, "tp")
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


def test_mla_is_stored_once_and_loaded_by_every_rank(tmp_path):
    mla, gqa = start_tp(tmp_path / "mla", True), start_tp(tmp_path / "gqa", False)
    wrong, stored, committed = run_tp(*mla)
    assert wrong == [0, 0]  # rank 1 reads rank 0's copy, byte for byte
    assert committed == [6, 0]  # one rank wrote each chunk
    wrong_gqa, stored_gqa, committed_gqa = run_tp(*gqa)
    assert wrong_gqa == [0, 0] and committed_gqa == [6, 6]
    assert stored * TP == stored_gqa  # MLA: 1/TP of the bytes
