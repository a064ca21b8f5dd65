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
it. Chunks are ``chunk_tokens // block_size`` blocks.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpool.config import PoolConfig, load_pool_config
from vllm_kvpool.engine import TransferEngine
from vllm_kvpool.handlers import MediumHandler, open_handlers, restorable_chunks
from vllm_kvpool.kv_layout import KVLayout
from vllm_kvpool.metrics import PoolStatus
from vllm_kvpool.placement import DeviceWeights
from vllm_kvpool.pool import PoolGeometry, UnifiedPool, layout_fingerprint
from vllm_kvpool.probe import probe_bandwidths, probe_copy_threads
from vllm_kvpool.protocol import ChunkRead, ChunkSave, LoadRequest, WorkerReport


@dataclass(frozen=True)
class FetchResult:
    blocks: int  # blocks found in the pool and copied into the KV
    seconds: float  # from issuing the loads to the last byte in the KV
    ok: bool  # every chunk verified (False: some blocks must be recomputed)


class LocalPool:
    """A pool over ``config``'s devices serving the KV tensors ``kv_caches``."""

    def __init__(self, config: PoolConfig | dict[str, Any] | str, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int, block_size: int, bandwidths: Sequence[float] | None = None,
                 layout_id: object = "local") -> None:  # fmt: skip
        self.config = load_pool_config(config)
        self.layout = KVLayout.from_kv_caches(kv_caches, list(kv_caches), num_blocks)
        self.block_size = block_size
        bpc = self.config.check_block_size(block_size)
        self.geometry = PoolGeometry(self.layout.block_bytes, bpc,
                                     layout_fingerprint([layout_id, self.layout.block_bytes, bpc]))
        self.geometry.check_capacity(self.config)
        gbps = list(bandwidths) if bandwidths is not None else probe_bandwidths(self.config,
                                                                                 self.geometry)
        self.pool = UnifiedPool(self.config, self.geometry,
                                DeviceWeights(gbps, self.config.probe.drift_threshold))
        for device, chunks in restorable_chunks(self.config, self.geometry).items():
            self.pool.restore(device, chunks)  # a previous run's SSD chunks (same layout_id)
        self.engine = TransferEngine(open_handlers(self.config, self.geometry), self.layout,
                                     verify_checksums=self.config.verify_checksums,
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
        bpc = self.geometry.blocks_per_chunk
        chunks = [(f, block_hashes[f : f + bpc]) for f in range(0, len(block_hashes), bpc)]
        planned = self.pool.plan_saves(req_id, chunks)
        saves = [ChunkSave(req_id, p.entry.key, p.entry.location.device, p.entry.location.slot,
                           tuple(block_ids[p.first_block : p.first_block
                                           + p.entry.location.num_blocks]),
                           block_hashes=p.entry.block_hashes)
                 for p in planned]  # fmt: skip
        self.engine.finish_step_saves(saves)
        self.engine.wait_all()
        self.pool.forget_request(req_id)
        report = self._apply(self.engine.take_report())
        return sum(1 for key, _, _ in report.committed
                   if (e := self.pool.index.get(key)) is not None and e.committed)  # fmt: skip

    def fetch(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
              timeout: float = 600.0, devices: Collection[int] | None = None) -> FetchResult:  # fmt: skip
        """Copy the longest stored prefix of ``block_hashes`` into ``block_ids``; with
        ``devices``, only that prefix's chunks held on those devices (one share of the fetch
        alone: the blocks of the other chunks are left as they are)."""
        hits = self.pool.match(block_hashes)
        if devices is not None:
            hits = [h for h in hits if h.entry.location.device in devices]
        reads = tuple(ChunkRead(h.entry.key, h.entry.location.device, h.entry.location.slot,
                                h.entry.location.num_blocks, dict(h.entry.checksums), 0,
                                tuple(block_ids[h.first_block : h.first_block + h.num_blocks]),
                                verify=not h.entry.validated)
                      for h in hits)  # fmt: skip
        self._requests += 1
        req_id = f"local-{self._requests}"
        if devices is None:  # a share fetched alone is a measurement, not a lookup
            self.pool.record_lookup(len(block_hashes) * self.block_size,
                                    sum(h.num_blocks for h in hits) * self.block_size)  # fmt: skip
            if reads:
                self.pool.record_load([h.entry for h in hits])
        self.pool.pin([h.entry for h in hits])
        try:
            start = time.perf_counter()
            self.engine.start_loads([LoadRequest(req_id, reads, is_async=True)])
            deadline = start + timeout
            while req_id not in self.engine.take_finished([])[1]:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"kvpool: fetch of {len(reads)} chunks took over {timeout} s")
                time.sleep(0.0002)
            seconds = time.perf_counter() - start
        finally:
            self.pool.unpin([h.entry for h in hits])
        invalid = self.engine.take_invalid_blocks()
        self._apply(self.engine.take_report())
        return FetchResult(sum(h.num_blocks for h in hits), seconds, not invalid)

    def status(self) -> PoolStatus:
        """Per-device usage and traffic, hit counters (what ``kvpool status`` shows)."""
        self._apply(self.engine.take_report())
        return self.pool.status()

    def _apply(self, report: WorkerReport) -> WorkerReport:
        self.pool.apply_report(report)
        return report

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
