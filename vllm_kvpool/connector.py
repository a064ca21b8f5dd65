"""``UnifiedKVPoolConnector``: the vLLM ``KVConnectorBase_V1`` glue around the pool.

Scheduler side (one per engine): answers ``get_num_new_matched_tokens`` from the index,
turns allocations into load jobs, picks devices for new chunks, keeps blocks of finishing
requests alive until their saves are written. Worker side (one per rank): runs the
``TransferEngine``. Both sides exchange only plain dataclasses (``PoolStepMetadata`` down,
``PoolWorkerMetadata`` up), so the engine may put them in different processes.

Load
  ``vllm serve M --kv-transfer-config '{"kv_connector":"UnifiedKVPoolConnector",
  "kv_connector_module_path":"vllm_kvpool.connector","kv_role":"kv_both",
  "kv_connector_extra_config":{"pool":"/etc/kvpool.yaml"}}'``
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvpool.config import PoolConfig, PoolConfigError, pool_config_from_extra
from vllm_kvpool.index import ChunkEntry
from vllm_kvpool.metrics import (
    counter_delta,
    default_status_path,
    flat_counters,
    reduce_counters,
)
from vllm_kvpool.placement import DeviceWeights
from vllm_kvpool.pool import PoolGeometry, UnifiedPool, layout_fingerprint
from vllm_kvpool.transfer import ChunkRead, ChunkSave, LoadRequest, WorkerReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvpool")
STATUS_INTERVAL_S = 1.0


# ----------------------------------------------------------------------------- metadata
@dataclass
class PoolStepMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    deferred_free: list[str] = field(default_factory=list)  # finished, blocks kept for saves


@dataclass
class PoolWorkerMetadata(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PoolWorkerMetadata)
        self.report.merge(other.report)
        return self


@dataclass
class KVPoolStats(KVConnectorStats):
    """Counter deltas of one interval (see ``metrics.flat_counters``); summed across sources."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_counters(self.data)

    def is_empty(self) -> bool:
        return not self.data


# ----------------------------------------------------------------------------- helpers
def _single_group(kv_cache_config: KVCacheConfig) -> Any:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvpool supports one KV cache group (got {len(groups)}); vLLM turns "
                         "the hybrid KV cache manager off for this connector")  # fmt: skip
    return groups[0]


def pool_geometry(config: PoolConfig, vllm_config: VllmConfig,
                  kv_cache_config: KVCacheConfig) -> PoolGeometry:  # fmt: skip
    """Chunk geometry both sides derive from vLLM's KV cache config."""
    group = _single_group(kv_cache_config)
    spec = group.kv_cache_spec
    page = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    block_size = vllm_config.cache_config.block_size
    bpc = config.check_block_size(block_size)
    version = layout_fingerprint([tuple(group.layer_names), page, str(spec.dtype), block_size,
                                  type(spec).__name__])  # fmt: skip
    return PoolGeometry(block_bytes=page * len(group.layer_names), blocks_per_chunk=bpc,
                        layout_version=version)  # fmt: skip


def _world(vllm_config: VllmConfig) -> tuple[int, int]:
    """(this worker's rank, number of workers holding shards of every chunk)."""
    world = vllm_config.parallel_config.world_size
    rank = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank() % world
    return rank, world


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # first chunk not yet saved in full
    partial_saved: bool = False  # chunk next_chunk's partial prompt copy was saved
    inflight_saves: set[bytes] = field(default_factory=set)
    counted: bool = False


# ----------------------------------------------------------------------------- connector
class UnifiedKVPoolConnector(KVConnectorBase_V1):
    """One logical KV pool over host-memory pools and SSDs, striped by bandwidth."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost state

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:  # fmt: skip
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.pool_config = pool_config_from_extra(extra)
        self.geometry = pool_geometry(self.pool_config, vllm_config, kv_cache_config)
        self.geometry.check_capacity(self.pool_config)
        self.block_size = vllm_config.cache_config.block_size
        self.rank, self.world_size = _world(vllm_config)
        self.status_path = extra.get("status_file") or str(default_status_path())
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self.engine = None  # created once register_kv_caches shows the real tensors

    # ========================================================== scheduler side
    def _init_scheduler(self) -> None:
        from vllm_kvpool.storage import probe_bandwidths

        # A cache: a chunk that fails to load is recomputed instead of failing the request.
        # vLLM reads this policy right after building the scheduler-side connector.
        self._kv_transfer_config.kv_load_failure_policy = self.pool_config.load_failure
        gbps = probe_bandwidths(self.pool_config, self.geometry)
        logger.info("kvpool: placement weights (GB/s): %s", dict(
            zip((d.name for d in self.pool_config.devices), gbps, strict=True)))  # fmt: skip
        weights = DeviceWeights(gbps, drift_threshold=self.pool_config.probe.drift_threshold)
        self.pool = UnifiedPool(self.pool_config, self.geometry, weights, self.world_size)
        self._requests: dict[str, _RequestState] = {}
        self._lookups: dict[str, tuple[int, list]] = {}
        self._load_pins: dict[str, list[ChunkEntry]] = {}
        self._sync_loads: list[str] = []
        self._save_owner: dict[bytes, str] = {}
        self._next_meta = PoolStepMetadata()
        self._stats_sent: dict[str, float] = {}
        self._status_written = 0.0

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        # At least one prompt token must be computed to produce logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.match(request.block_hashes[:max_blocks])
        matched = sum(h.num_blocks for h in hits) * self.block_size
        self._lookups[request.request_id] = (num_computed_tokens, hits)
        external = matched - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self.pool_config.load_mode == "async"

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:  # fmt: skip
        req_id = request.request_id
        state = self._requests.setdefault(req_id, _RequestState(request))
        computed, hits = self._lookups.pop(req_id, (0, []))
        if not state.counted:
            state.counted = True
            self.pool.lookups.query_tokens += request.num_tokens
            self.pool.lookups.hit_tokens += num_external_tokens
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        first = computed // self.block_size
        last = (computed + num_external_tokens) // self.block_size
        reads, pinned = [], []
        for hit in hits:
            lo, hi = max(hit.first_block, first), min(hit.first_block + hit.num_blocks, last)
            if lo >= hi:
                continue
            loc = hit.entry.location
            reads.append(ChunkRead(hit.entry.key, loc.device, loc.slot, loc.num_blocks,
                                   dict(hit.entry.checksums), lo - hit.first_block,
                                   tuple(block_ids[lo:hi])))  # fmt: skip
            pinned.append(hit.entry)
        self.pool.pin(pinned)
        self._load_pins[req_id] = pinned
        is_async = self.pool_config.load_mode == "async"
        if not is_async:
            self._sync_loads.append(req_id)
        self.pool.lookups.loads += 1
        self._next_meta.loads.append(LoadRequest(req_id, tuple(reads), is_async))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._next_meta = self._next_meta, PoolStepMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_saves(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_saves(state, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _plan_saves(self, state: _RequestState, num_done: int, meta: PoolStepMetadata) -> None:
        """Save full chunks once computed (prompt, and generated tokens with ``save_decode``)
        and the prompt's partial last chunk once, at the prompt's end; a chunk that generated
        tokens fill later replaces that partial copy."""
        request, bpc = state.request, self.geometry.blocks_per_chunk
        prompt_blocks = request.num_prompt_tokens // self.block_size
        limit = min(num_done // self.block_size, len(request.block_hashes), len(state.block_ids))
        if not self.pool_config.save_decode:
            limit = min(limit, prompt_blocks)
        chunks = []
        c = state.next_chunk
        while c * bpc < limit:
            end = min((c + 1) * bpc, limit)
            hashes = request.block_hashes[c * bpc : end]
            if end < (c + 1) * bpc:  # partial: only the prompt's last chunk, once, at its end
                if state.partial_saved or end < prompt_blocks or c * bpc >= prompt_blocks:
                    break
                state.partial_saved = True
                chunks.append((c * bpc, hashes))
                break  # revisited once generated tokens complete it
            if self.pool.shorter_copy_unsettled(hashes):
                break  # the partial copy is still being written: replace it in a later step
            chunks.append((c * bpc, hashes))
            c += 1
            state.partial_saved = False
        state.next_chunk = c
        if not chunks:
            return
        for planned in self.pool.plan_saves(request.request_id, chunks):
            entry, first = planned.entry, planned.first_block
            ids = tuple(state.block_ids[first : first + entry.location.num_blocks])
            meta.saves.append(ChunkSave(request.request_id, entry.key, entry.location.device,
                                        entry.location.slot, ids))  # fmt: skip
            state.inflight_saves.add(entry.key)
            self._save_owner[entry.key] = request.request_id

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PoolWorkerMetadata):
            self._apply_report(meta.report)
        for req_id in list(connector_output.finished_recving or ()) + self._sync_loads:
            self.pool.unpin(self._load_pins.pop(req_id, []))
        self._sync_loads = []
        now = time.monotonic()
        if now - self._status_written > STATUS_INTERVAL_S:
            self._write_status()
            self._status_written = now

    def _apply_report(self, report: WorkerReport) -> None:
        for key, rank, checksum in report.committed:
            self.pool.acknowledge_save(key, rank, checksum)
            entry = self.pool.index.get(key)
            if entry is None or entry.committed:
                self._save_finished(key)
        for key in report.failed_saves:
            self.pool.invalidate(key)
            self._save_finished(key)
        for key in report.corrupt:
            self.pool.invalidate(key)
        for device, reason in report.failed_devices.items():
            if not self.pool.weights.failed[device]:
                logger.error("kvpool: %s failed (%s); its chunks are now misses",
                             self.pool_config.devices[device].name, reason)  # fmt: skip
                self.pool.fail_device(device)
        for device, nbytes, seconds in report.observations:
            if self.pool.weights.observe(device, nbytes, seconds):
                logger.info("kvpool: re-weighted %s to %.2f GB/s",
                            self.pool_config.devices[device].name,
                            self.pool.weights.gbps[device])  # fmt: skip
        self.pool.transfers.merge(report.counters)

    def _save_finished(self, key: bytes) -> None:
        req_id = self._save_owner.pop(key, None)
        state = self._requests.get(req_id) if req_id else None
        if state is not None:
            state.inflight_saves.discard(key)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self.pool.forget_request(req_id)
        state = self._requests.pop(req_id, None)
        if state is None or not state.inflight_saves:
            return False, None
        # Saves still copying from these blocks: vLLM frees them once get_finished says so.
        self._next_meta.deferred_free.append(req_id)
        return True, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        now = flat_counters(self.pool.status())
        delta = counter_delta(now, self._stats_sent)
        self._stats_sent = now
        return KVPoolStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVPoolStats(data=dict(data or {}))

    def _write_status(self) -> None:
        try:
            self.pool.status().write(self.status_path)
        except OSError as exc:  # status is best effort; serving goes on
            logger.debug("kvpool: cannot write status file %s: %s", self.status_path, exc)

    def reset_cache(self) -> bool | None:
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        for entry in list(self.pool.index.oldest_first()):
            if entry.committed:
                self.pool.invalidate(entry.key)
        return True

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._write_status()
        elif self.engine is not None:
            self.engine.close()
            self.engine = None

    # ========================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm_kvpool.storage import open_tiers
        from vllm_kvpool.transfer import KVLayout, TransferEngine

        group = _single_group(self._kv_cache_config)
        layout = KVLayout.from_kv_caches(kv_caches, group.layer_names,
                                         self._kv_cache_config.num_blocks)  # fmt: skip
        if layout.block_bytes != self.geometry.block_bytes:
            raise PoolConfigError(
                "chunk layout", f"KV tensors hold {layout.block_bytes} bytes per block, the "
                f"KV cache spec says {self.geometry.block_bytes}")  # fmt: skip
        suffix = f".rank{self.rank}" if self.world_size > 1 else ""
        tiers = open_tiers(self.pool_config, self.geometry, suffix)
        self.engine = TransferEngine(tiers, layout, self.rank, self.pool_config.verify_checksums)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 sleep mode, before the KV memory is unmapped: finish every background
        gather/scatter so none touches it. The pool keeps its own copies and the KV views keep
        their virtual addresses across sleep, so ``restore_kv_caches`` has nothing to redo."""
        if self.engine is not None:
            self.engine.wait_all()

    def _meta(self) -> PoolStepMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, PoolStepMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and self.engine is not None:
            self.engine.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.engine is not None:
            self.engine.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        meta = self._meta()
        if meta is not None and self.engine is not None:
            self.engine.save_layer(meta.saves, layer_name)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is None or self.engine is None:
            return
        self.engine.finish_step_saves(meta.saves)
        self.engine.wait_sync_loads()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.engine is not None:  # preempted blocks get reused: finish copying out of them
            self.engine.flush_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.engine is None:
            return None, None
        meta = self._meta()
        sending, recving = self.engine.take_finished(meta.deferred_free if meta else [])
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.engine.take_invalid_blocks() if self.engine is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.engine is None:
            return None
        report = self.engine.take_report()
        return None if report.is_empty() else PoolWorkerMetadata(report)
