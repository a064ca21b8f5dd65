"""Worker side of the connector (one per rank): the transfer engine over this rank's media.

Built once ``register_kv_caches`` shows vLLM's real KV tensors; turns each step's
``PoolStepMetadata`` into engine calls and the engine's report into ``PoolWorkerMetadata``.
"""

from __future__ import annotations

import torch

from vllm_kvpool.config import PoolConfig, PoolConfigError
from vllm_kvpool.connector_meta import PoolStepMetadata, PoolWorkerMetadata
from vllm_kvpool.engine import TransferEngine
from vllm_kvpool.layout import ChunkKV, ChunkLayout
from vllm_kvpool.pools import open_media, shards
from vllm_kvpool.probe import probe_copy_threads
from vllm_kvpool.service.remote import ServiceClient


class PoolWorker:
    """The worker-side role of ``UnifiedKVPoolConnector``."""

    def __init__(self, config: PoolConfig, layout: ChunkLayout, rank: int,
                 world_size: int, engine: str = "engine") -> None:  # fmt: skip
        self.pool_config = config
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        # The copy of each chunk this rank reads and (when it is the copy's owner) writes:
        # its own shard, or with one copy for all ranks (``pools.shards``) rank 0's.
        self.shards = shards(config, layout, world_size)
        self.shard = rank if self.shards == world_size else 0
        self.saves = self.shard == rank
        self.engine_id = engine
        self.engine: TransferEngine | None = None
        self.service: ServiceClient | None = None  # the pool service's connection, if any
        # vLLM maps block-level load errors back to requests only with one KV cache group;
        # with several, a failed load is reported per request (and recomputed whole).
        self.per_request_failures = layout.num_groups > 1

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        try:
            kv = ChunkKV.from_kv_caches(kv_caches, self.layout, num_blocks)
        except ValueError as exc:
            raise PoolConfigError("chunk layout", str(exc)) from exc
        self.service, handlers = open_media(self.pool_config, self.layout, self.shard,
                                            self.shards, self.engine_id)  # fmt: skip
        self.engine = TransferEngine(handlers, kv, self.shard, self.pool_config.verify_checksums,
                                     self.pool_config.device_retry_seconds,
                                     probe_copy_threads(self.pool_config))  # fmt: skip

    def drain(self) -> None:
        if self.engine is not None:
            self.engine.wait_all()

    def start_load(self, meta: PoolStepMetadata | None) -> None:
        if meta is not None and self.engine is not None:
            self._follow_service(meta)
            self.engine.start_loads(meta.loads)

    def _follow_service(self, meta: PoolStepMetadata) -> None:
        """The scheduler side attached to a restarted pool service: map its new host memory
        before running jobs planned there (the first hook of every step)."""
        if self.service is not None:
            self.service.follow(meta.service_epoch)

    def wait_layer(self, layer_name: str) -> None:
        if self.engine is not None:
            self.engine.wait_layer(layer_name)

    def save_layer(self, meta: PoolStepMetadata | None, layer_name: str) -> None:
        if meta is not None and self.engine is not None and self.saves:
            self.engine.save_layer(meta.saves, layer_name)

    def finish_step(self, meta: PoolStepMetadata | None) -> None:
        if meta is None or self.engine is None:
            return
        if self.saves:  # a rank reading another's copy has nothing to write (nor to move)
            self.engine.finish_step_saves(meta.saves)
            self.engine.start_moves(meta.moves, meta.move_rate)
        self.engine.wait_sync_loads()

    def flush_saves(self) -> None:
        if self.engine is not None:  # preempted blocks get reused: finish copying out of them
            self.engine.flush_saves()

    def transfer_results(self, meta: PoolStepMetadata | None) -> tuple[set[str], set[str], set[str]]:
        """(finished saves, finished async loads, those of them that failed)."""
        if self.engine is None:
            return set(), set(), set()
        sending, recving, failed = self.engine.take_finished(meta.deferred_free if meta else [])
        return sending, recving, failed if self.per_request_failures else set()

    def invalid_blocks(self) -> set[int]:
        if self.engine is None:
            return set()
        blocks = self.engine.take_invalid_blocks()
        return set() if self.per_request_failures else blocks  # reported per request instead

    def worker_meta(self) -> PoolWorkerMetadata | None:
        if self.engine is None:
            return None
        report = self.engine.take_report()
        return None if report.is_empty() else PoolWorkerMetadata(report)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.service is not None:
            self.service.close()
            self.service = None
