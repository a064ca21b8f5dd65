"""``UnifiedKVPoolConnector``: the vLLM ``KVConnectorBase_V1`` glue around the pool.

Thin: it derives the chunk layout from vLLM's KV cache config and delegates every hook to
the scheduler-side role (``scheduler.PoolScheduler``: index, placement, saves) or the
worker-side role (``worker.PoolWorker``: the transfer engine). The two exchange only the
messages of ``protocol`` (wrapped in ``connector_meta``), so vLLM may run them in different
processes.

Load
  ``vllm serve M --kv-transfer-config '{"kv_connector":"UnifiedKVPoolConnector",
  "kv_connector_module_path":"vllm_kvpool.connector","kv_role":"kv_both",
  "kv_connector_extra_config":{"pool":"/etc/kvpool.yaml"}}'``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvpool.config import PoolConfigError, pool_config_from_extra
from vllm_kvpool.connector_meta import KVPoolStats, PoolStepMetadata
from vllm_kvpool.identity import engine_identity
from vllm_kvpool.layout import build as layouts
from vllm_kvpool.metrics import default_status_path
from vllm_kvpool.pool import UnifiedPool
from vllm_kvpool.pools import shards
from vllm_kvpool.service.remote import RemotePool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_kvpool.engine import TransferEngine


def _world(vllm_config: VllmConfig) -> tuple[int, int]:
    """(this worker's rank, number of workers holding shards of every chunk)."""
    world = vllm_config.parallel_config.world_size
    rank = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank() % world
    return rank, world


def _engine_id(vllm_config: VllmConfig) -> str:
    """One id for all processes of this vLLM instance (the pool service's per-engine leases)."""
    return str(vllm_config.kv_transfer_config.engine_id)


class UnifiedKVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """One logical KV pool over host-memory pools and SSDs, striped by bandwidth.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on; each KV cache group is its own
    section of every chunk (sliding-window groups only the window, see ``layout``)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost state

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:  # fmt: skip
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.pool_config = pool_config_from_extra(extra)
        # One section per KV cache group (several when vLLM's hybrid manager is on). Chunks of
        # another model, dtype, TP layout or block hashing are never served (SSD chunks outlive
        # the process: their index records carry the layout's fingerprint).
        self.layout = layouts.from_vllm(self.pool_config, kv_cache_config,
                                       vllm_config.cache_config.block_size,
                                       engine_identity(vllm_config))  # fmt: skip
        if self.layout.num_groups > 1 and self.pool_config.load_mode == "sync":
            raise PoolConfigError("load_mode", "'sync' cannot report a chunk that fails to load "
                                  f"for a model with {self.layout.num_groups} KV cache groups "
                                  "(vLLM recomputes only failed async loads there); use "
                                  "'async'")  # fmt: skip
        rank, world_size = _world(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvpool.scheduler import PoolScheduler

            # A cache: a chunk that fails to load is recomputed instead of failing the request.
            # vLLM reads this policy right after building the scheduler-side connector.
            self._kv_transfer_config.kv_load_failure_policy = self.pool_config.load_failure
            block_size = vllm_config.cache_config.block_size
            hash_block = kv_cache_config.hash_block_size or block_size
            self.scheduler = PoolScheduler(
                self.pool_config, self.layout, block_size,
                shards(self.pool_config, self.layout, world_size),
                extra.get("status_file") or str(default_status_path()),
                hash_scale=block_size // hash_block,
                engine=_engine_id(vllm_config))  # fmt: skip
        else:
            from vllm_kvpool.worker import PoolWorker

            self.worker = PoolWorker(self.pool_config, self.layout, rank, world_size,
                                     _engine_id(vllm_config))  # fmt: skip

    @property
    def pool(self) -> UnifiedPool | RemotePool:
        """The scheduler side's pool (index, slots, placement, counters)."""
        return self.scheduler.pool

    @property
    def engine(self) -> TransferEngine | None:
        """The worker side's transfer engine (None until ``register_kv_caches``)."""
        return self.worker.engine

    # ========================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:  # fmt: skip
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """``SupportsHMA``: once per request, before vLLM frees any group's blocks."""
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while saves are unacknowledged: an idle engine takes no step, and
        only a step brings the worker's commits back (else the next identical prompt misses)."""
        return self._role == KVConnectorRole.SCHEDULER and self.scheduler.has_unsettled_saves()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        return self.scheduler.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVPoolStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self._role == KVConnectorRole.SCHEDULER else None

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self.scheduler.shutdown()
        else:
            self.worker.close()

    # ========================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 sleep mode, before the KV memory is unmapped: finish every background
        gather/scatter so none touches it. The pool keeps its own copies and the KV views keep
        their virtual addresses across sleep, so ``restore_kv_caches`` has nothing to redo."""
        self.worker.drain()

    def _meta(self) -> PoolStepMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, PoolStepMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        self.worker.save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self.worker.finish_step(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.flush_saves()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.transfer_results(self._meta())
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.worker_meta()
