"""The pool without vLLM, in one process: for benchmarks, the demo and tools.

The same scheduler-side pool (``UnifiedPool``: index, placement, eviction) and worker-side
engine (``TransferEngine`` over the media handlers) the connector runs, driven directly:

    pool = LocalPool(config, kv_caches, num_blocks)      # KV tensors as vLLM lays them out
    pool.save(block_hashes, block_ids)                   # chunks committed (blocks' KV stored)
    result = pool.fetch(block_hashes, block_ids)         # longest stored prefix -> those blocks
    pool.status().transfers.devices["ssd0"].bytes_read   # per-device counters
    pool.close()

``block_hashes[i]`` names block i of a sequence (any bytes; chained over the prefix like
vLLM's, so a key names the whole prefix up to it) and ``block_ids[i]`` is the KV block holding
it (in every layer's tensor). Chunks are ``chunk_tokens // block_size`` blocks. The chunk layout
comes from the tensors (every layer full attention), or from a model's geometry
(``layout.build.from_model``: sliding-window groups keep only their window, as in vLLM).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpool.config import PoolConfig, load_pool_config
from vllm_kvpool.engine import TransferEngine
from vllm_kvpool.handlers import MediumHandler
from vllm_kvpool.index import ChunkEntry
from vllm_kvpool.layout import ChunkKV, ChunkLayout
from vllm_kvpool.layout import build as layouts
from vllm_kvpool.metrics import PoolStatus
from vllm_kvpool.migration import DEFAULT_MARGIN
from vllm_kvpool.pool import prefix_blocks
from vllm_kvpool.pools import open_media, open_pool
from vllm_kvpool.probe import probe_copy_threads
from vllm_kvpool.protocol import ChunkRead, LoadRequest, WorkerReport


@dataclass(frozen=True)
class FetchResult:
    blocks: int  # blocks found in the pool and copied into the KV
    seconds: float  # from issuing the loads to the last byte in the KV
    ok: bool  # every chunk verified (False: some blocks must be recomputed)


@dataclass(frozen=True)
class FetchPlan:
    """A fetch planned by the pool (``LocalPool.plan``), not yet run."""

    blocks: int  # blocks of the hit the reads fill
    reads: tuple[ChunkRead, ...]
    entries: list[ChunkEntry]  # the chunks read (pinned while they are)


class LocalPool:
    """A pool over ``config``'s devices serving the KV tensors ``kv_caches``.

    ``layout``: the chunk layout (default: from the tensors, ``layout_id`` in its fingerprint so
    a previous run's SSD chunks are served only to the same ``layout_id``)."""

    def __init__(self, config: PoolConfig | dict[str, Any] | str, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int, block_size: int, bandwidths: Sequence[float] | None = None,
                 layout_id: object = "local", layout: ChunkLayout | None = None) -> None:  # fmt: skip
        self.config = load_pool_config(config)
        self.block_size = block_size
        self.layout = layout if layout is not None else layouts.from_kv_caches(
            self.config, kv_caches, num_blocks, block_size, [layout_id])
        self.layout.check_capacity(self.config)
        kv = ChunkKV.from_kv_caches(kv_caches, self.layout, num_blocks)
        engine = f"local-{os.getpid()}-{id(self):x}"
        self.pool = open_pool(self.config, self.layout, 1, engine, bandwidths)
        self.service, handlers = open_media(self.config, self.layout, 0, 1, engine)
        self.engine = TransferEngine(handlers, kv, verify_checksums=self.config.verify_checksums,
                                     retry_seconds=self.config.device_retry_seconds,
                                     copy_threads=probe_copy_threads(self.config))  # fmt: skip
        self._requests = 0

    @property
    def handlers(self) -> list[MediumHandler]:
        """One per configured device, in config order."""
        return self.engine.tiers

    def save(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Store the chunks of a sequence not yet in the pool; returns how many were committed."""
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"block_hashes has {len(block_hashes)} entries, block_ids "
                             f"{len(block_ids)}")  # fmt: skip
        self._requests += 1
        req_id = f"local-{self._requests}"
        bpc = self.layout.blocks_per_chunk
        chunks = [(f, block_hashes[f : f + bpc]) for f in range(0, len(block_hashes), bpc)]
        jobs = self.pool.save_jobs(req_id, chunks, self._group_ids(block_ids))
        self._follow_service()
        self.engine.finish_step_saves(jobs)
        self.engine.wait_all()
        self.pool.forget_request(req_id)
        return len(self._apply(self.engine.take_report()).committed)  # one rank: each commits

    def fetch(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
              timeout: float = 600.0, devices: Collection[int] | None = None) -> FetchResult:  # fmt: skip
        """Copy the longest stored prefix of ``block_hashes`` into ``block_ids`` (the connector's
        load of a hit: the window at the hit's end of sliding-window groups); with ``devices``,
        only that prefix's chunks held on those devices (one share of the fetch alone: the
        blocks of the other chunks are left as they are)."""
        return self.run(self.plan(block_hashes, block_ids, devices), timeout)

    def plan(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
             devices: Collection[int] | None = None) -> FetchPlan:  # fmt: skip
        """The pool's side of ``fetch``: the lookup and the chunks' read jobs, nothing moved."""
        hits = self.pool.lookup(block_hashes)
        self._follow_service()
        jobs = self.pool.load_jobs(hits, self._group_ids(block_ids))
        if devices is not None:
            hits = [h for h in hits if h.entry.location.device in devices]
            jobs = [(r, e) for r, e in jobs if r.device in devices]
        entries = [e for _, e in jobs]
        if devices is None:  # a share fetched alone is a measurement, not a lookup
            self.pool.record_lookup(len(block_hashes) * self.block_size,
                                    prefix_blocks(hits) * self.block_size)  # fmt: skip
            if jobs:
                self.pool.record_load(entries)
        return FetchPlan(sum(h.num_blocks for h in hits), tuple(r for r, _ in jobs), entries)

    def run(self, plan: FetchPlan, timeout: float = 600.0) -> FetchResult:
        """The engine's side of ``fetch``: run a plan's reads (its chunks pinned meanwhile);
        ``seconds`` from issuing them to the last byte in the KV."""
        self._requests += 1
        req_id = f"local-{self._requests}"
        self.pool.pin(plan.entries)
        try:
            start = time.perf_counter()
            self.engine.start_loads([LoadRequest(req_id, plan.reads, is_async=True)])
            deadline = start + timeout
            while req_id not in self.engine.take_finished([])[1]:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"kvpool: fetch of {len(plan.reads)} chunks took over "
                                       f"{timeout} s")  # fmt: skip
                time.sleep(0.0002)
            seconds = time.perf_counter() - start
        finally:
            self.pool.unpin(plan.entries)
        invalid = self.engine.take_invalid_blocks()
        self._apply(self.engine.take_report())
        return FetchResult(plan.blocks, seconds, not invalid)

    def migrate(self, bytes_per_second: float, margin: float = DEFAULT_MARGIN,
                limit: int = 1 << 30) -> int:  # fmt: skip
        """Start moving stored chunks off devices whose share time exceeds another's by
        ``margin`` (``migration``), in the background at ``bytes_per_second``; fetches go on
        meanwhile. Returns how many chunks were sent; each moves once its copy is reported
        (any later ``fetch``, ``status`` or ``wait_moves``)."""
        if self.service is not None:
            raise NotImplementedError("kvpool: migration is not wired through the pool service "
                                      "yet; run it with the in-process pool")  # fmt: skip
        moves = self.pool.plan_moves(margin, limit)
        self.engine.start_moves(moves, bytes_per_second)
        return len(moves)

    def wait_moves(self) -> None:
        """Until every move started so far is copied (or failed), and settle them."""
        self.engine.wait_moves()
        self._apply(self.engine.take_report())

    def _follow_service(self) -> None:
        if self.service is not None:
            self.service.follow(self.pool.epoch)

    def _group_ids(self, block_ids: Sequence[int]) -> list[Sequence[int]]:
        """Every layer's tensor is indexed by the same block ids: one table per group."""
        return [block_ids] * self.layout.num_group_tables

    def status(self) -> PoolStatus:
        """Per-device usage and traffic, hit counters (what ``kvpool status`` shows)."""
        self._apply(self.engine.take_report())
        return self.pool.status()

    def _apply(self, report: WorkerReport) -> WorkerReport:
        self.pool.apply_report(report)
        return report

    def close(self) -> None:
        self.engine.close()
        if self.service is not None:
            self.service.close()
            self.pool.close()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
