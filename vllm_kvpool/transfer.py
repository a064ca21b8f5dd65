"""Worker side: move chunks between vLLM's paged KV tensors and the pool's devices.

A chunk holds ``num_blocks`` vLLM blocks of every layer this worker owns, layer-major:
``[layer][block][page bytes]`` where a page is the block's bytes of that layer in vLLM's logical
``[H, N, C]`` order. Layer-major lets a layer of many blocks be gathered/scattered in one
``index_select``/``index_copy_`` straight between KV tensor and pool memory, whatever physical
``KVCacheLayout`` vLLM chose.

Loads issue every device's reads at once (one batched ticket per SSD, host chunks need none)
into staging buffers, then scatter into the KV blocks; when the whole load fits the staging
buffers it scatters layer by layer and signals each layer so ``wait_for_layer_load`` releases
early layers first. Saves gather on a background thread (``save_kv_layer`` only enqueues) and
write asynchronously; the scheduler keeps the source blocks until the save is reported.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_kvpool.metrics import TransferCounters
from vllm_kvpool.storage import HostTier, SsdTier, Tier, kvio

logger = logging.getLogger("vllm_kvpool")
COPY_THREADS = 2  # GIL-free memcpy threads per gather/scatter (C++ copy_many)
MAX_SEGMENTS = 4096  # host segments of one direct read (one backend request each)


# ----------------------------------------------------------------------------- step jobs
@dataclass(frozen=True)
class ChunkSave:
    req_id: str
    key: bytes
    device: int
    slot: int
    block_ids: tuple[int, ...]  # vLLM block ids holding the chunk, in order


@dataclass(frozen=True)
class ChunkRead:
    key: bytes
    device: int
    slot: int
    stored_blocks: int  # blocks in the stored chunk (its layout)
    checksums: dict[int, int]  # worker rank -> checksum of that rank's shard
    skip: int  # leading blocks of the chunk already present (local prefix-cache hit)
    block_ids: tuple[int, ...]  # destination vLLM blocks for chunk blocks skip, skip+1, ...


@dataclass(frozen=True)
class LoadRequest:
    req_id: str
    reads: tuple[ChunkRead, ...]
    is_async: bool


@dataclass
class WorkerReport:
    """What a worker tells the scheduler-side pool after a step (mergeable across ranks)."""

    committed: list[tuple[bytes, int, int]] = field(default_factory=list)  # key, rank, checksum
    failed_saves: list[bytes] = field(default_factory=list)
    corrupt: list[bytes] = field(default_factory=list)
    failed_devices: dict[int, str] = field(default_factory=dict)
    observations: list[tuple[int, int, float]] = field(default_factory=list)  # dev, bytes, secs
    counters: TransferCounters = field(default_factory=TransferCounters)

    def merge(self, other: WorkerReport) -> WorkerReport:
        self.committed += other.committed
        self.failed_saves += other.failed_saves
        self.corrupt += other.corrupt
        self.failed_devices.update(other.failed_devices)
        self.observations += other.observations
        self.counters.merge(other.counters)
        return self

    def is_empty(self) -> bool:
        return not (self.committed or self.failed_saves or self.corrupt or self.failed_devices
                    or self.observations or not self.counters.is_empty())  # fmt: skip


# ----------------------------------------------------------------------------- KV layout
@dataclass(frozen=True)
class LayerPages:
    name: str
    tensor: torch.Tensor  # vLLM's per-layer view, logical [kernel_blocks, H, N, C]
    ratio: int  # kernel blocks per vLLM block (vLLM may split a block for the kernel)
    page_bytes: int  # bytes of one vLLM block of this layer


@dataclass
class KVLayout:
    layers: list[LayerPages]
    layer_prefix: list[int] = field(default_factory=list)  # page bytes of the layers before

    def __post_init__(self) -> None:
        acc = 0
        self.layer_prefix = []
        for layer in self.layers:
            self.layer_prefix.append(acc)
            acc += layer.page_bytes
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._plan = self._uniform_plan()

    def _uniform_plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int] | None:
        """(KV base, KV page stride, page bytes before the layer, ratio, kernel page bytes), when
        all layers have contiguous CPU pages of one size: ``chunk_ops`` is then one numpy
        expression instead of a loop over layers (it runs once per chunk, holding the GIL)."""
        if not self.layers:
            return None
        first = self.layers[0]
        for layer in self.layers:
            if (not _contiguous_pages(layer) or layer.ratio != first.ratio
                    or layer.page_bytes != first.page_bytes):  # fmt: skip
                return None
        base = np.array([layer.tensor.data_ptr() for layer in self.layers], dtype=np.uint64)
        stride = np.array([layer.tensor.stride(0) * layer.tensor.element_size()
                           for layer in self.layers], dtype=np.uint64)  # fmt: skip
        prefix = np.array(self.layer_prefix, dtype=np.uint64)
        return base, stride, prefix, first.ratio, first.page_bytes // first.ratio

    @property
    def block_bytes(self) -> int:
        return sum(layer.page_bytes for layer in self.layers)

    @classmethod
    def from_kv_caches(
        cls, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int
    ) -> KVLayout:
        """Learn vLLM's real per-layer KV views (as ``register_kv_caches`` hands them over)."""
        layers = []
        for name in layer_names:
            t = kv_caches[name]
            if t.shape[0] % num_blocks:
                raise ValueError(f"kvpool: KV tensor of {name} has {t.shape[0]} blocks, not a "
                                 f"multiple of the {num_blocks} blocks vLLM allocated")  # fmt: skip
            ratio = t.shape[0] // num_blocks
            page = t[0].numel() * t.element_size() * ratio
            layers.append(LayerPages(name, t, ratio, page))
        return cls(layers)

    def offset(self, layer: int, num_blocks: int) -> int:
        """Byte offset of ``layer`` inside a chunk of ``num_blocks`` blocks."""
        return num_blocks * self.layer_prefix[layer]

    def _ids(self, layer: LayerPages, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        if layer.ratio > 1:
            ids = (ids[:, None] * layer.ratio + torch.arange(layer.ratio)).reshape(-1)
        return ids.to(layer.tensor.device, non_blocking=True)

    def _host_view(self, buf: torch.Tensor, layer: LayerPages, n: int) -> torch.Tensor:
        t = layer.tensor
        return buf[: n * layer.page_bytes].view(t.dtype).view(n * layer.ratio, *t.shape[1:])

    def _page_ops(self, layer: LayerPages, block_ids: Sequence[int], chunk_addr: int,
                  to_kv: bool) -> np.ndarray | None:  # fmt: skip
        """(dst, src, nbytes) rows, one per kernel page; None unless ``_contiguous_pages``."""
        if not _contiguous_pages(layer):
            return None
        t = layer.tensor
        return _copy_rows(np.array([t.data_ptr()], dtype=np.uint64),
                          np.array([t.stride(0) * t.element_size()], dtype=np.uint64),
                          np.array([chunk_addr], dtype=np.uint64), layer.ratio,
                          layer.page_bytes // layer.ratio, block_ids, to_kv)  # fmt: skip

    def chunk_ops(self, block_ids: Sequence[int], chunk_addr: int, to_kv: bool,
                  stored: int | None = None, skip: int = 0) -> np.ndarray | None:  # fmt: skip
        """Copy rows for chunk blocks ``skip..skip+len(block_ids)`` of a chunk of ``stored``
        blocks (every layer, in chunk byte order), adjacent pages merged; None unless every
        layer's pages are contiguous CPU memory (see ``_page_ops``)."""
        stored = len(block_ids) if stored is None else stored
        if self._plan is not None:
            base, stride, prefix, ratio, kpage = self._plan
            host = np.uint64(chunk_addr + skip * ratio * kpage) + prefix * np.uint64(stored)
            return _merge_adjacent(_copy_rows(base, stride, host, ratio, kpage, block_ids, to_kv))
        parts = []
        for li, layer in enumerate(self.layers):
            addr = chunk_addr + self.offset(li, stored) + skip * layer.page_bytes
            ops = self._page_ops(layer, block_ids, addr, to_kv)
            if ops is None:
                return None
            parts.append(ops)
        return _merge_adjacent(np.concatenate(parts)) if parts else None

    def direct_segments(self, block_ids: Sequence[int], mem_align: int,
                        align: int) -> np.ndarray | None:  # fmt: skip
        """(kv_addr, nbytes) rows that let an O_DIRECT read land straight in the KV pages of a
        full chunk (no staging copy): only when the pages are CPU memory aligned for the device."""
        ops = self.chunk_ops(block_ids, 0, to_kv=True)
        if ops is None or len(ops) > MAX_SEGMENTS:
            return None
        dst, nbytes = ops[:, 0], ops[:, 2]
        if (dst % np.uint64(mem_align)).any() or (nbytes % np.uint64(align)).any():
            return None
        return np.ascontiguousarray(ops[:, [0, 2]])

    def gather(self, li: int, block_ids: Sequence[int], chunk: torch.Tensor, stored: int) -> None:
        """Copy layer ``li`` of ``block_ids`` from the KV tensor into the chunk buffer."""
        layer = self.layers[li]
        n = len(block_ids)
        region = chunk[self.offset(li, stored) :]
        ops = self._page_ops(layer, block_ids, region.data_ptr(), to_kv=False)
        if ops is not None:
            kvio().copy_many(ops, threads=COPY_THREADS)
            return
        dst = self._host_view(region, layer, n)
        ids = self._ids(layer, block_ids)
        if layer.tensor.device.type == "cpu":
            torch.index_select(layer.tensor, 0, ids, out=dst)
        else:
            dst.copy_(layer.tensor.index_select(0, ids))

    def scatter(self, li: int, block_ids: Sequence[int], chunk: torch.Tensor, stored: int,
                skip: int = 0) -> None:  # fmt: skip
        """Copy chunk blocks ``skip..skip+len(block_ids)`` of layer ``li`` into the KV."""
        layer = self.layers[li]
        region = chunk[self.offset(li, stored) + skip * layer.page_bytes :]
        ops = self._page_ops(layer, block_ids, region.data_ptr(), to_kv=True)
        if ops is not None:
            kvio().copy_many(ops, threads=COPY_THREADS)
            return
        src = self._host_view(region, layer, len(block_ids))
        ids = self._ids(layer, block_ids)
        layer.tensor.index_copy_(0, ids, src.to(layer.tensor.device, non_blocking=True))


def _contiguous_pages(layer: LayerPages) -> bool:
    """Whether each kernel page ([H, N, C]) is one run of CPU memory (LBHNC, BLHNC, ...)."""
    t = layer.tensor
    return t.device.type == "cpu" and t[0].is_contiguous()


def _copy_rows(kv_base: np.ndarray, kv_stride: np.ndarray, host_base: np.ndarray, ratio: int,
               kpage: int, block_ids: Sequence[int], to_kv: bool) -> np.ndarray:  # fmt: skip
    """(dst, src, nbytes) rows, one per kernel page, layer by layer: layer l's KV pages start at
    ``kv_base[l]``, ``kv_stride[l]`` bytes apart; its run in the chunk starts at ``host_base[l]``."""
    ids = np.asarray(block_ids, dtype=np.uint64)[:, None] * np.uint64(ratio)
    kernel = (ids + np.arange(ratio, dtype=np.uint64)).reshape(-1)
    kv = (kv_base[:, None] + kernel[None, :] * kv_stride[:, None]).ravel()
    host = (host_base[:, None]
            + np.arange(kernel.size, dtype=np.uint64)[None, :] * np.uint64(kpage)).ravel()  # fmt: skip
    ops = np.empty((kv.size, 3), dtype=np.uint64)
    ops[:, 0], ops[:, 1] = (kv, host) if to_kv else (host, kv)
    ops[:, 2] = kpage
    return ops


def _merge_adjacent(ops: np.ndarray) -> np.ndarray:
    """Merge consecutive (dst, src, nbytes) rows that continue each other in both buffers."""
    if len(ops) < 2:
        return ops
    ends_dst = ops[:-1, 0] + ops[:-1, 2]
    ends_src = ops[:-1, 1] + ops[:-1, 2]
    starts = np.flatnonzero(np.concatenate(
        ([True], (ops[1:, 0] != ends_dst) | (ops[1:, 1] != ends_src))))  # fmt: skip
    merged = ops[starts].copy()
    merged[:, 2] = np.add.reduceat(ops[:, 2], starts)
    return merged


def _pop(chunks: deque) -> Any:
    """Next item of a deque two threads consume (``popleft`` is atomic), or None when empty."""
    try:
        return chunks.popleft()
    except IndexError:
        return None


def _sync_device(layout: KVLayout) -> None:
    if layout.layers and layout.layers[0].tensor.device.type == "cuda":
        torch.cuda.current_stream().synchronize()


# ----------------------------------------------------------------------------- engine
class _Worker:
    """One daemon thread running tasks in FIFO order; failures are logged, never dropped.

    (Not a ThreadPoolExecutor: those refuse work during interpreter shutdown, exactly when
    vLLM asks the connector to drain.)
    """

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.add_done_callback(_log_failure)
        self._tasks.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter / logged
                future.set_exception(exc)

    def shutdown(self) -> None:
        self._tasks.put(None)
        self._thread.join()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("kvpool: background transfer task failed", exc_info=future.exception())


@dataclass
class _PendingRead:
    req: LoadRequest
    read: ChunkRead
    nbytes: int
    buf: torch.Tensor | None = None  # chunk bytes once available
    staging: tuple[Any, int] | None = None  # (StagingSlots, slot) to give back
    segments: np.ndarray | None = None  # KV pages a direct read fills (then no buf/staging)
    ok: bool = True


@dataclass
class _Wave:
    ticket: int
    reads: list[_PendingRead]
    submitted: float


@dataclass
class _SaveBuffer:
    job: ChunkSave
    buf: torch.Tensor
    addr: int
    staging: tuple[Any, int] | None


class TransferEngine:
    """All worker-side data movement of one rank; thread-safe entry points for the connector."""

    def __init__(self, tiers: list[Tier], layout: KVLayout, rank: int = 0,
                 verify_checksums: bool = True) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.rank = rank
        self.verify = verify_checksums
        self.io = kvio()
        self._views: dict[int, torch.Tensor] = {}
        self._saver = _Worker("kvpool-save")
        self._loader = _Worker("kvpool-load")
        self._reaper = _Worker("kvpool-reap")
        self._copier = _Worker("kvpool-copy")
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._pending_saves: dict[str, int] = defaultdict(int)
        self._finished_loads: set[str] = set()
        self._awaiting_free: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._layer_events: list[threading.Event] = []
        self._step_buffers: Future | None = None
        self._step_layers: set[int] = set()
        self._failed = [False] * len(tiers)

    # -- memory views ----------------------------------------------------------------------
    def _view(self, pool: Any) -> torch.Tensor:
        key = id(pool)
        if key not in self._views:
            self._views[key] = torch.frombuffer(pool, dtype=torch.uint8)
        return self._views[key]

    def _host_chunk(self, tier: HostTier, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * tier.slot_bytes
        return self._view(tier.pool)[start : start + nbytes]

    def _staging_chunk(self, tier: SsdTier, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * tier.slot_bytes
        return self._view(tier.staging.pool)[start : start + nbytes]

    def _device_failed(self, device: int, reason: str) -> None:
        with self._lock:
            if not self._failed[device]:
                logger.error("kvpool: device %s failed: %s", self.tiers[device].cfg.name, reason)
            self._failed[device] = True
            self._report.failed_devices[device] = reason
            self._report.counters.device(self.tiers[device].cfg.name).errors += 1

    # -- saves -----------------------------------------------------------------------------
    def save_layer(self, saves: Sequence[ChunkSave], layer_name: str) -> None:
        """Enqueue the gather of one layer for this step's saves (never blocks the forward)."""
        if not saves or layer_name not in self.layout.index:
            return
        self._ensure_step_buffers(saves)
        li = self.layout.index[layer_name]
        self._step_layers.add(li)
        event = self._record_event()
        self._saver.submit(self._gather_layer, self._step_buffers, li, event)

    def finish_step_saves(self, saves: Sequence[ChunkSave]) -> None:
        """Enqueue the rest of this step's saves: missing layers, checksum, device writes."""
        if not saves:
            return
        self._ensure_step_buffers(saves)
        missing = [i for i in range(len(self.layout.layers)) if i not in self._step_layers]
        event = self._record_event()
        for li in missing:
            self._saver.submit(self._gather_layer, self._step_buffers, li, event)
        self._saver.submit(self._write_step, self._step_buffers)
        self._step_buffers, self._step_layers = None, set()

    def _ensure_step_buffers(self, saves: Sequence[ChunkSave]) -> None:
        if self._step_buffers is None:
            with self._lock:
                for job in saves:
                    self._pending_saves[job.req_id] += 1
            self._step_buffers = self._saver.submit(self._take_buffers, list(saves))

    def _record_event(self) -> Any:
        tensor = self.layout.layers[0].tensor if self.layout.layers else None
        if tensor is not None and tensor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def _take_buffers(self, saves: list[ChunkSave]) -> list[_SaveBuffer]:
        buffers = []
        for job in saves:
            tier = self.tiers[job.device]
            nbytes = len(job.block_ids) * self.layout.block_bytes
            if isinstance(tier, HostTier):
                buffers.append(_SaveBuffer(job, self._host_chunk(tier, job.slot, nbytes),
                                           tier.address(job.slot), None))  # fmt: skip
            elif slots := tier.staging.take(1, block=False):
                buffers.append(_SaveBuffer(job, self._staging_chunk(tier, slots[0], nbytes),
                                           tier.staging.address(slots[0]),
                                           (tier.staging, slots[0])))  # fmt: skip
            else:  # staging busy: a private aligned buffer, so a big step can never deadlock
                spill = self.io.HostPool(tier.slot_bytes, numa_node=tier.cfg.numa_node,
                                         hugepages=False, name=f"{tier.cfg.name}-spill")  # fmt: skip
                view = torch.frombuffer(spill, dtype=torch.uint8)[:nbytes]
                buffers.append(_SaveBuffer(job, view, spill.address, (None, spill)))
        return buffers

    def _gather_layer(self, buffers_future: Future, li: int, event: Any) -> None:
        buffers = buffers_future.result()
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        for b in buffers:
            n = len(b.job.block_ids)
            self.layout.gather(li, b.job.block_ids, b.buf, n)

    def _write_step(self, buffers_future: Future) -> None:
        buffers = buffers_future.result()
        _sync_device(self.layout)
        by_device: dict[int, list[_SaveBuffer]] = defaultdict(list)
        for b in buffers:
            tier = self.tiers[b.job.device]
            if self._failed[b.job.device]:
                self._save_done(b, None, "device failed")
            elif isinstance(tier, HostTier):
                nbytes = len(b.job.block_ids) * self.layout.block_bytes
                self._save_done(b, self.io.checksum(b.addr, nbytes), None, elapsed=0.0)
            else:
                by_device[b.job.device].append(b)
        for device, group in by_device.items():
            tier = self.tiers[device]
            assert isinstance(tier, SsdTier)
            nbytes = [len(b.job.block_ids) * self.layout.block_bytes for b in group]
            ops = [(tier.offset(b.job.slot), b.addr, tier.io_length(n))
                   for b, n in zip(group, nbytes, strict=True)]  # fmt: skip
            start = time.perf_counter()
            try:
                ticket = tier.device.submit_write(ops)
            except OSError as exc:
                self._device_failed(device, str(exc))
                for b in group:
                    self._save_done(b, None, str(exc))
                continue
            self._reaper.submit(self._reap_writes, device, ticket, group, start)

    def _reap_writes(self, device: int, ticket: int, group: list[_SaveBuffer], start: float):
        tier = self.tiers[device]
        results = tier.device.wait(ticket, check=False)
        elapsed = time.perf_counter() - start
        errors = [r.message for r in results if not r.ok]
        if errors:
            self._device_failed(device, errors[0])
        for b, r in zip(group, results, strict=True):
            self._save_done(b, r.checksum if r.ok else None, r.message or None,
                            elapsed=elapsed / len(group))  # fmt: skip

    def _save_done(self, b: _SaveBuffer, checksum: int | None, error: str | None,
                   elapsed: float = 0.0) -> None:  # fmt: skip
        if b.staging is not None and b.staging[0] is not None:
            b.staging[0].give([b.staging[1]])
        b.staging = None  # drops a spill buffer
        name = self.tiers[b.job.device].cfg.name
        with self._lock:
            if checksum is None:
                self._report.failed_saves.append(b.job.key)
            else:
                self._report.committed.append((b.job.key, self.rank, checksum))
                c = self._report.counters.device(name)
                c.bytes_written += len(b.job.block_ids) * self.layout.block_bytes
                c.write_seconds += elapsed
                c.chunks_written += 1
            self._pending_saves[b.job.req_id] -= 1
            if self._pending_saves[b.job.req_id] <= 0:
                del self._pending_saves[b.job.req_id]
        if error and checksum is None:
            logger.warning("kvpool: save of a chunk to %s failed: %s", name, error)

    def flush_saves(self) -> None:
        """Wait until every enqueued gather has copied its blocks (before blocks are reused)."""
        self._saver.submit(lambda: None).result()

    def wait_all(self) -> None:
        self.flush_saves()
        self._loader.submit(lambda: None).result()
        self._reaper.submit(lambda: None).result()

    # -- loads -----------------------------------------------------------------------------
    def start_loads(self, loads: Sequence[LoadRequest]) -> None:
        """Issue this step's loads; sync ones release layers through ``wait_layer``."""
        if not loads:
            return
        sync = any(not r.is_async for r in loads)
        events = [threading.Event() for _ in self.layout.layers]
        if sync:
            self._layer_events = events
        self._loader.submit(self._run_loads, list(loads), events)

    def wait_layer(self, layer_name: str) -> None:
        li = self.layout.index.get(layer_name)
        if li is not None and self._layer_events:
            self._layer_events[li].wait()

    def wait_sync_loads(self) -> None:
        for event in self._layer_events:
            event.wait()
        self._layer_events = []

    def _run_loads(self, loads: list[LoadRequest], events: list[threading.Event]) -> None:
        start = time.perf_counter()
        try:
            self._load_batch(loads, events)
        except Exception:  # never leave the forward waiting: every chunk of the batch fails
            logger.exception("kvpool: load batch failed")
            with self._lock:
                for req in loads:
                    for r in req.reads:
                        self._invalid_blocks.update(r.block_ids)
        finally:
            for e in events:
                e.set()
        elapsed = time.perf_counter() - start
        with self._lock:
            for req in loads:
                self._report.counters.fetch_seconds.append(elapsed)
                if req.is_async:
                    self._finished_loads.add(req.req_id)

    def _load_batch(self, loads: list[LoadRequest], events: list[threading.Event]) -> None:
        """Keep every SSD busy (two waves in flight each) while the host chunks are copied."""
        pending = [_PendingRead(req, r, r.stored_blocks * self.layout.block_bytes)
                   for req in loads for r in req.reads]  # fmt: skip
        queues: dict[int, deque[_PendingRead]] = defaultdict(deque)
        host: list[_PendingRead] = []
        for p in pending:
            tier = self.tiers[p.read.device]
            if self._failed[p.read.device]:
                p.ok = False
            elif isinstance(tier, HostTier):
                host.append(p)
            else:
                p.segments = self._direct_segments(tier, p)
                queues[p.read.device].append(p)
        fits = all(sum(p.segments is None for p in q) <= self.tiers[d].staging.total
                   for d, q in queues.items())  # fmt: skip
        layer_major = fits and any(not r.is_async for r in loads)
        if layer_major:  # verify now, scatter layer by layer once everything is here
            for p in host:
                self._read_host(p, scatter=False)
        host_queue = deque() if layer_major else deque(host)
        # Host chunks are verified and copied by this thread AND the copier, one chunk each at a
        # time (hashing, not memory, limits one thread); this thread also keeps the SSDs busy.
        copier = self._copier.submit(self._drain_host, host_queue) if len(host_queue) > 1 else None
        inflight: dict[int, deque[_Wave]] = defaultdict(deque)
        last_done: dict[int, float] = {}
        while host_queue or any(queues.values()) or any(inflight.values()):
            progressed = False
            for d in list(queues):
                self._fill(d, queues[d], inflight[d], fits)
                while inflight[d] and self.tiers[d].device.poll(inflight[d][0].ticket):
                    self._finish_wave(d, inflight[d].popleft(), last_done, layer_major)
                    progressed = True
            if (p := _pop(host_queue)) is not None:
                self._read_host(p, scatter=True, threads=1 if copier else COPY_THREADS)
            elif not progressed:
                busy = [d for d in inflight if inflight[d]]
                if len(busy) == 1:  # one device left: sleep in the kernel until it is done
                    self._finish_wave(busy[0], inflight[busy[0]].popleft(), last_done, layer_major)
                else:
                    time.sleep(0.0002)
        if copier is not None:
            copier.result()
        if layer_major:
            good = [p for p in pending if p.ok and p.buf is not None]
            for li, event in enumerate(events):
                for p in good:
                    self.layout.scatter(li, p.read.block_ids, p.buf, p.read.stored_blocks, p.read.skip)
                if self.layout.layers[li].tensor.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                event.set()
            self._release(pending)
        _sync_device(self.layout)
        with self._lock:
            for p in pending:
                if not p.ok:
                    self._invalid_blocks.update(p.read.block_ids)

    def _direct_segments(self, tier: SsdTier, p: _PendingRead) -> np.ndarray | None:
        """KV pages a full-chunk read can fill directly (CPU KV cache aligned for O_DIRECT)."""
        r = p.read
        if r.skip or len(r.block_ids) != r.stored_blocks or tier.io_length(p.nbytes) != p.nbytes:
            return None
        dev = tier.device
        return self.layout.direct_segments(r.block_ids, dev.mem_alignment, dev.alignment)

    def _fill(self, device: int, queue: deque[_PendingRead], waves: deque[_Wave],
              fits: bool) -> None:  # fmt: skip
        """Submit reads until two waves are in flight or the staging buffers are all taken."""
        tier = self.tiers[device]
        assert isinstance(tier, SsdTier)
        wave_size = tier.staging.total if fits else max(1, tier.staging.total // 2)
        while queue and len(waves) < 2:
            wave: list[_PendingRead] = []
            ops = []
            staged = 0  # reads of this wave that take a staging buffer (direct ones do not)
            while queue and staged < wave_size:
                p = queue[0]
                target: Any = p.segments
                if target is None:
                    slots = tier.staging.take(1, block=False)
                    if not slots:
                        break  # staging busy (also used by saves): retry on the next round
                    staged += 1
                    p.staging = (tier.staging, slots[0])
                    p.buf = self._staging_chunk(tier, slots[0], p.nbytes)
                    target = tier.staging.address(slots[0])
                queue.popleft()
                wave.append(p)
                expected = p.read.checksums.get(self.rank) if self.verify else None
                ops.append((tier.offset(p.read.slot), target, tier.io_length(p.nbytes), expected))
            if not wave:
                return
            try:
                waves.append(_Wave(tier.device.submit_read(ops), wave, time.perf_counter()))
            except OSError as exc:
                self._device_failed(device, str(exc))
                for p in (*wave, *queue):
                    p.ok = False
                self._release(wave)
                queue.clear()
                return

    def _finish_wave(self, device: int, wave: _Wave, last_done: dict[int, float],
                     layer_major: bool) -> None:  # fmt: skip
        tier = self.tiers[device]
        results = tier.device.wait(wave.ticket, check=False)
        now = time.perf_counter()
        # Waves overlap: charge the device only for the time since its previous completion.
        elapsed = now - max(wave.submitted, last_done.get(device, 0.0))
        last_done[device] = now
        good_bytes = 0
        counters = WorkerReport()
        c = counters.counters.device(tier.cfg.name)
        for p, r in zip(wave.reads, results, strict=True):
            if r.ok:
                good_bytes += p.nbytes
                continue
            p.ok = False
            if r.status == "corrupt":
                c.corrupt += 1
                counters.corrupt.append(p.read.key)
                logger.warning("kvpool: corrupt chunk on %s (recomputed): %s", tier.cfg.name,
                               r.message)  # fmt: skip
            else:
                self._device_failed(device, r.message)
        c.bytes_read += good_bytes
        c.read_seconds += elapsed
        c.chunks_read += sum(p.ok for p in wave.reads)
        counters.observations.append((device, good_bytes, elapsed))
        with self._lock:
            self._report.merge(counters)
        if not layer_major:
            for p in wave.reads:
                if p.ok and p.buf is not None:
                    self._scatter(p)
            self._release(wave.reads)

    def _scatter(self, p: _PendingRead, threads: int = COPY_THREADS) -> None:
        """Copy a chunk buffer into its KV blocks, all layers in one pass where it can."""
        assert p.buf is not None
        r = p.read
        ops = self.layout.chunk_ops(r.block_ids, p.buf.data_ptr(), True, r.stored_blocks, r.skip)
        if ops is not None:
            self.io.copy_many(ops, threads=threads)
            return
        for li in range(len(self.layout.layers)):
            self.layout.scatter(li, r.block_ids, p.buf, r.stored_blocks, r.skip)

    def _drain_host(self, chunks: deque[_PendingRead]) -> None:
        while (p := _pop(chunks)) is not None:
            self._read_host(p, scatter=True, threads=1)

    def _read_host(self, p: _PendingRead, scatter: bool, threads: int = COPY_THREADS) -> None:
        """Verify a host-pool chunk; with ``scatter``, copy it into the KV blocks in the same pass
        (a corrupt chunk's blocks are reported invalid and recomputed, so its bytes do no harm)."""
        tier = self.tiers[p.read.device]
        assert isinstance(tier, HostTier)
        start = time.perf_counter()
        p.buf = self._host_chunk(tier, p.read.slot, p.nbytes)
        r = p.read
        expected = r.checksums.get(self.rank) if self.verify else None
        ops = None
        if scatter and expected is not None and not r.skip and len(r.block_ids) == r.stored_blocks:
            # The whole chunk goes to the KV in byte order: hash it while it is copied.
            ops = self.layout.chunk_ops(r.block_ids, tier.address(r.slot), to_kv=True)
        if ops is not None:
            p.ok = self.io.copy_many_checksum(ops) == expected
        else:
            if expected is not None:
                p.ok = self.io.checksum(tier.address(r.slot), p.nbytes) == expected
            if scatter and p.ok:
                self._scatter(p, threads)
        with self._lock:
            c = self._report.counters.device(tier.cfg.name)
            if p.ok:
                c.bytes_read += p.nbytes
                c.chunks_read += 1
                c.read_seconds += time.perf_counter() - start
            else:
                c.corrupt += 1
                self._report.corrupt.append(p.read.key)
                logger.warning("kvpool: corrupt chunk in host pool %s (recomputed)", tier.cfg.name)

    @staticmethod
    def _release(reads: list[_PendingRead]) -> None:
        for p in reads:
            if p.staging is not None:
                p.staging[0].give([p.staging[1]])
                p.staging = None
            p.buf = None

    # -- reporting -------------------------------------------------------------------------
    def take_finished(self, deferred_free: Sequence[str]) -> tuple[set[str], set[str]]:
        """(requests whose deferred block free may happen now, finished async loads).

        ``deferred_free``: requests the scheduler newly kept alive for their saves; they are
        remembered until their last save is done.
        """
        with self._lock:
            self._awaiting_free.update(deferred_free)
            sending = {r for r in self._awaiting_free if self._pending_saves.get(r, 0) == 0}
            self._awaiting_free -= sending
            recving, self._finished_loads = self._finished_loads, set()
        return sending, recving

    def pending_saves(self, req_id: str) -> int:
        with self._lock:
            return self._pending_saves.get(req_id, 0)

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_report(self) -> WorkerReport:
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return out

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            for worker in (self._saver, self._loader, self._reaper, self._copier):
                worker.shutdown()
            for tier in self.tiers:
                tier.close()
