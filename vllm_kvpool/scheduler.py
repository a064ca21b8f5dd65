"""Scheduler side of the connector (one per engine): the pool's index, placement and saves.

Answers lookups from the index, turns allocations into load jobs, plans the saves of every
request's new chunks (prompt and, with ``save_decode``, generated tokens), keeps the blocks of
finishing requests alive until their saves are written, and applies the workers' reports
(commits, failures, device health, observed bandwidth). Talks to the workers only through
``PoolStepMetadata`` / ``PoolWorkerMetadata``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.connector_meta import KVPoolStats, PoolStepMetadata, PoolWorkerMetadata
from vllm_kvpool.index import ChunkEntry
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.metrics import counter_delta, flat_counters, flat_gauges
from vllm_kvpool.pool import prefix_blocks
from vllm_kvpool.pools import open_pool
from vllm_kvpool.protocol import LoadRequest, WorkerReport
from vllm_kvpool.service.remote import RemotePool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvpool")
STATUS_INTERVAL_S = 1.0


@dataclass
class _RequestState:
    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    computed: int = 0  # tokens computed before this step (vLLM freed windows up to there)
    next_chunk: int = 0  # first chunk not yet saved in full
    stopped: bool = False  # a chunk could not be saved: nothing after it can ever match
    partial_saved: bool = False  # chunk next_chunk's partial prompt copy was saved
    inflight_saves: set[bytes] = field(default_factory=set)
    counted: bool = False


class PoolScheduler:
    """The scheduler-side role of ``UnifiedKVPoolConnector``."""

    def __init__(self, config: PoolConfig, layout: ChunkLayout, block_size: int,
                 world_size: int, status_path: str, hash_scale: int = 1,
                 engine: str = "engine") -> None:  # fmt: skip
        self.pool_config = config
        self.layout = layout
        self.block_size = block_size
        self.hash_scale = hash_scale  # vLLM hashes blocks of block_size / hash_scale tokens
        self.status_path = status_path
        self.pool = open_pool(config, layout, world_size, engine)
        self._requests: dict[str, _RequestState] = {}
        self._lookups: dict[str, tuple[int, list]] = {}
        self._save_waits: dict[str, float] = {}  # request -> monotonic end of its wait for saves
        self._load_pins: dict[str, list[ChunkEntry]] = {}
        self._sync_loads: list[str] = []
        self._save_owner: dict[bytes, str] = {}
        self._next_meta = PoolStepMetadata()
        self._stats_sent: dict[str, float] = {}
        self._gauges_sent: dict[str, float] = {}
        self._status_written = 0.0
        self._moves_planned = 0.0  # monotonic time of the last plan of moves

    # -- lookups and loads -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        # At least one prompt token must be computed to produce logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, pending = self.pool.lookup_pending(self._hashes(request)[:max_blocks])
        matched = prefix_blocks(hits) * self.block_size
        if pending * self.block_size > max(matched, num_computed_tokens) \
                and self._may_wait(request.request_id):  # fmt: skip
            return None, False  # vLLM asks again next step, after that step's worker report
        self._save_waits.pop(request.request_id, None)
        self._lookups[request.request_id] = (num_computed_tokens, hits)
        external = matched - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self.pool_config.load_mode == "async"

    def _may_wait(self, req_id: str) -> bool:
        """Whether a request may still be held for the save of the chunk its pooled prefix
        runs into. The save is planned and its data is being (or was just) written, but its
        commit reaches this side only with a step's worker report, which vLLM applies after
        that step's lookups: a request arriving right after the one that saved the chunk (or
        while it is still being written) would miss it and recompute what the pool is about
        to hold. Held at most ``save_wait_seconds`` from its first hold (a stuck device)."""
        now = time.monotonic()
        return now < self._save_waits.setdefault(req_id, now + self.pool_config.save_wait_seconds)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:  # fmt: skip
        req_id = request.request_id
        state = self._requests.setdefault(req_id, _RequestState(request))
        computed, hits = self._lookups.pop(req_id, (0, []))
        if not state.counted:
            state.counted = True
            self.pool.record_lookup(request.num_tokens, num_external_tokens)
        if num_external_tokens <= 0:
            return
        jobs = self.pool.load_jobs(hits, blocks.get_block_ids(), computed // self.block_size,
                                   (computed + num_external_tokens) // self.block_size)  # fmt: skip
        pinned = [entry for _, entry in jobs]
        self.pool.pin(pinned)
        self._load_pins[req_id] = pinned
        is_async = self.pool_config.load_mode == "async"
        if not is_async:
            self._sync_loads.append(req_id)
        self.pool.record_load(pinned)
        self._next_meta.loads.append(LoadRequest(req_id, tuple(r for r, _ in jobs), is_async))

    def _hashes(self, request: Request) -> list:
        """The request's block hashes at the pool's block size (vLLM may hash finer)."""
        if self.hash_scale == 1:
            return request.block_hashes
        return request.block_hashes[self.hash_scale - 1 :: self.hash_scale]

    # -- saves -----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolStepMetadata:
        meta, self._next_meta = self._next_meta, PoolStepMetadata()
        meta.service_epoch = getattr(self.pool, "epoch", "")
        self._plan_moves(meta)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            state.computed = new.num_computed_tokens
            self._plan_saves(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids is not None:
                for mine, ids in zip(state.block_ids, new_ids, strict=True):
                    mine.extend(ids)
            state.computed = cached.num_computed_tokens[i]
            self._plan_saves(state, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _plan_moves(self, meta: PoolStepMetadata) -> None:
        """Every ``migration.every`` seconds, with no earlier move still copying: the stored
        chunks to move in the background (``migration``; the pool pins them meanwhile)."""
        mig = self.pool_config.migration
        now = time.monotonic()
        if not mig.enabled or now - self._moves_planned < mig.every or self.pool.moves:
            return
        self._moves_planned = now
        meta.moves = self.pool.plan_moves(mig.margin)
        meta.move_rate = float(mig.bandwidth)

    def _plan_saves(self, state: _RequestState, num_done: int, meta: PoolStepMetadata) -> None:
        """Save full chunks once computed (prompt, and generated tokens with ``save_decode``)
        and the prompt's partial last chunk once, at the prompt's end; a chunk that generated
        tokens fill later replaces that partial copy."""
        request, bpc = state.request, self.layout.blocks_per_chunk
        if state.stopped or not state.block_ids:
            return
        hashes_all = self._hashes(request)
        prompt_blocks = request.num_prompt_tokens // self.block_size
        limit = min(num_done // self.block_size, len(hashes_all),
                    min(len(ids) for ids in state.block_ids))  # fmt: skip
        if not self.pool_config.save_decode:
            limit = min(limit, prompt_blocks)
        chunks = []
        c = state.next_chunk
        while c * bpc < limit:
            end = min((c + 1) * bpc, limit)
            hashes = hashes_all[c * bpc : end]
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
        chunks = self._windows_held(state, chunks)
        if not chunks:
            return
        for save in self.pool.save_jobs(request.request_id, chunks, state.block_ids):
            meta.saves.append(save)
            state.inflight_saves.add(save.key)
            self._save_owner[save.key] = request.request_id

    def _windows_held(self, state: _RequestState,
                      chunks: list[tuple[int, list]]) -> list[tuple[int, list]]:  # fmt: skip
        """The chunks whose sliding-window tails vLLM still holds. A tail freed before its chunk
        was planned (its save deferred) is gone for good: that chunk and everything after it
        are not saved (a prefix with a hole never matches past it)."""
        if not self.layout.hybrid:
            return chunks
        for i, (first, hashes) in enumerate(chunks):
            if self.pool.is_stored(hashes):
                continue  # already pooled (e.g. loaded from it): nothing to copy
            for s in self.layout.sections(len(hashes)):
                if s.num_blocks and first + s.first < s.group.first_kept(state.computed):
                    state.stopped = True
                    return chunks[:i]
        return chunks

    # -- worker reports --------------------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PoolWorkerMetadata):
            self.apply_report(meta.report)
        for req_id in list(connector_output.finished_recving or ()) + self._sync_loads:
            self.pool.unpin(self._load_pins.pop(req_id, []))
        self._sync_loads = []
        now = time.monotonic()
        if now - self._status_written > STATUS_INTERVAL_S:
            self.write_status()
            self._status_written = now

    def apply_report(self, report: WorkerReport) -> None:
        for key in self.pool.apply_report(report):
            self._save_finished(key)

    def has_unsettled_saves(self) -> bool:
        """Saves planned whose outcome no worker reported yet."""
        return bool(self._save_owner)

    def _save_finished(self, key: bytes) -> None:
        req_id = self._save_owner.pop(key, None)
        state = self._requests.get(req_id) if req_id else None
        if state is not None:
            state.inflight_saves.discard(key)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._save_waits.pop(req_id, None)  # aborted while held
        self.pool.forget_request(req_id)
        state = self._requests.pop(req_id, None)
        if state is None or not state.inflight_saves:
            return False, None
        # Saves still copying from these blocks: vLLM frees them once get_finished says so.
        self._next_meta.deferred_free.append(req_id)
        return True, None

    # -- status ----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVPoolStats | None:
        status = self.pool.status()
        now, gauges = flat_counters(status), flat_gauges(status)
        delta = counter_delta(now, self._stats_sent)
        if not delta and gauges == self._gauges_sent:
            return None
        self._stats_sent, self._gauges_sent = now, gauges
        return KVPoolStats(data={**delta, **gauges})

    def write_status(self) -> None:
        try:
            self.pool.status().write(self.status_path)
        except OSError as exc:  # status is best effort; serving goes on
            logger.debug("kvpool: cannot write status file %s: %s", self.status_path, exc)

    def reset_cache(self) -> bool:
        self.pool.clear()
        return True

    def shutdown(self) -> None:
        self.write_status()
        if isinstance(self.pool, RemotePool):
            self.pool.close()  # this engine's leases drop at once
