"""Worker side: schedules chunk transfers between vLLM's paged KV and the pool's media.

The engine owns the threads and decides what moves when; the media handlers
(``vllm_kvpool.handlers``) move the bytes and the chunk layout (``layout.ChunkKV``) says where
they are in the KV.

Loads issue every device's reads at once (two batched waves in flight per SSD) into staging
buffers or straight into the KV pages, while resident (host-memory) chunks are verified and
copied into the KV by this thread and a copier thread; when the whole load fits the staging
buffers and a load is synchronous it scatters layer by layer and signals each layer so
``wait_for_layer_load`` releases early layers first. Saves gather on a background thread
(``save_layer`` only enqueues) and write asynchronously; the scheduler keeps the source blocks
until the save is reported. A failed medium is retried every ``retry_seconds`` and reported
back once it works again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvpool.device_copy import Copier, copier_for
from vllm_kvpool.handlers import Buffer, LoadOp, MediumHandler, SaveOp
from vllm_kvpool.layout.kv import COPY_THREADS, ChunkKV
from vllm_kvpool.native import kvio
from vllm_kvpool.protocol import ChunkRead, ChunkSave, LoadRequest, WorkerReport

logger = logging.getLogger("vllm_kvpool")


def _pop(chunks: deque) -> Any:
    """Next item of a deque two threads consume (``popleft`` is atomic), or None when empty."""
    try:
        return chunks.popleft()
    except IndexError:
        return None


def _sync_device(layout: ChunkKV) -> None:
    if layout.device.type == "cuda":
        torch.cuda.current_stream().synchronize()


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
    buf: Buffer | None = None  # where the chunk's bytes are once read (staged or resident)
    segments: np.ndarray | None = None  # KV pages a direct read fills (then no buf)
    ok: bool = True


@dataclass
class _Wave:
    ticket: int
    reads: list[_PendingRead]
    submitted: float


@dataclass
class _SaveBuffer:
    job: ChunkSave
    buf: Buffer


class TransferEngine:
    """All worker-side data movement of one rank; thread-safe entry points for the connector.

    ``tiers[d]`` is the handler of pool device ``d`` (the config's device order).
    """

    def __init__(self, tiers: list[MediumHandler], layout: ChunkKV, rank: int = 0,
                 verify_checksums: bool = False, retry_seconds: float = 10.0,
                 copy_threads: int = COPY_THREADS, copier: Copier | None = None) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.copier = copier if copier is not None else copier_for(layout.device)
        for handler in tiers:  # the host memory loads copy from (pinned for a GPU's DMA)
            for address, nbytes in handler.host_regions():
                self.copier.register_host(address, nbytes)
        self.rank = rank
        self.verify = verify_checksums  # also re-verify host-resident chunks on every fetch
        self.copy_threads = max(1, copy_threads)
        self.retry_seconds = retry_seconds
        self.io = kvio()
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
        self._failed_loads: set[str] = set()  # async loads with a chunk that did not load
        self._layer_events: list[threading.Event] = []
        self._layer_marks: list[Any] = []  # the copier's per-layer marks of the sync load
        self._step_buffers: Future | None = None
        self._step_layers: set[int] = set()
        self._failed_at: dict[int, float] = {}  # failed device -> last recovery attempt
        self._recovering = False

    def _device_failed(self, device: int, reason: str) -> None:
        handler = self.tiers[device]
        if handler.mark_failed(reason):
            logger.error("kvpool: device %s failed: %s", handler.name, reason)
        with self._lock:
            self._failed_at.setdefault(device, time.monotonic())
            self._report.failed_devices[device] = reason
            self._report.counters.device(handler.name).errors += 1

    def _retry_failed(self) -> None:
        """Give failed media a chance to come back (on the reaper thread, off the step)."""
        now = time.monotonic()
        with self._lock:
            due = [d for d, t in self._failed_at.items() if now - t >= self.retry_seconds]
            if not due or self._recovering:
                return
            self._recovering = True
            for d in due:
                self._failed_at[d] = now
        self._reaper.submit(self._recover, due)

    def _recover(self, devices: list[int]) -> None:
        try:
            for d in devices:
                if self.tiers[d].try_recover():
                    with self._lock:
                        self._failed_at.pop(d, None)
                        self._report.failed_devices.pop(d, None)
                        self._report.recovered_devices.append(d)
        finally:
            with self._lock:
                self._recovering = False

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
        copied = self._saver.submit(lambda: None)
        self._saver.submit(self._write_step, self._step_buffers)
        self._step_buffers, self._step_layers = None, set()
        if self.layout.hybrid:
            # Sliding-window groups free out-of-window blocks while the request runs, and the
            # next step may write them for another token: copy them out before returning.
            copied.result()

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
        return [_SaveBuffer(job, self.tiers[job.device].save_buffer(
                    job.slot, self.layout.save_bytes(job)))
                for job in saves]  # fmt: skip

    def _gather_layer(self, buffers_future: Future, li: int, event: Any) -> None:
        buffers = buffers_future.result()
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        for b in buffers:
            self.layout.gather_job(li, b.job, b.buf.view)

    def _write_step(self, buffers_future: Future) -> None:
        buffers = buffers_future.result()
        _sync_device(self.layout)
        by_device: dict[int, list[_SaveBuffer]] = defaultdict(list)
        for b in buffers:
            if self.tiers[b.job.device].failed:
                self._save_done(b, None, "device failed")
            else:
                by_device[b.job.device].append(b)
        for device, group in by_device.items():
            handler = self.tiers[device]
            ops = [SaveOp(b.job.slot, b.buf.address, self.layout.save_bytes(b.job),
                          b.job.block_hashes) for b in group]  # fmt: skip
            start = time.perf_counter()
            try:
                ticket = handler.submit_save(ops)
            except OSError as exc:
                self._device_failed(device, str(exc))
                for b in group:
                    self._save_done(b, None, str(exc))
                continue
            self._reaper.submit(self._reap_writes, device, ticket, group, start)

    def _reap_writes(self, device: int, ticket: int, group: list[_SaveBuffer], start: float):
        results = self.tiers[device].wait(ticket)
        elapsed = time.perf_counter() - start
        errors = [r.message for r in results if not r.ok]
        if errors:
            self._device_failed(device, errors[0])
        for b, r in zip(group, results, strict=True):
            self._save_done(b, r.checksum if r.ok else None, r.message or None,
                            elapsed=elapsed / len(group))  # fmt: skip

    def _save_done(self, b: _SaveBuffer, checksum: int | None, error: str | None,
                   elapsed: float = 0.0) -> None:  # fmt: skip
        b.buf.release()
        name = self.tiers[b.job.device].name
        with self._lock:
            if checksum is None:
                self._report.failed_saves.append(b.job.key)
            else:
                self._report.committed.append((b.job.key, self.rank, checksum))
                self._report.counters.device(name).count_write(self.layout.save_bytes(b.job),
                                                               elapsed)  # fmt: skip
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
        marks: list[Any] = [None] * len(events)
        if sync:
            self._layer_events, self._layer_marks = events, marks
        self._loader.submit(self._run_loads, list(loads), events, marks, self.copier.fence())

    def wait_layer(self, layer_name: str) -> None:
        """Until layer ``layer_name`` of the sync load is issued; then the forward's stream
        waits for that layer's copies only (the copier's mark)."""
        li = self.layout.index.get(layer_name)
        if li is not None and self._layer_events:
            self._layer_events[li].wait()
            self.copier.wait(self._layer_marks[li])

    def wait_sync_loads(self) -> None:
        for event, mark in zip(self._layer_events, self._layer_marks, strict=True):
            event.wait()
            self.copier.wait(mark)
        self._layer_events, self._layer_marks = [], []

    def _run_loads(self, loads: list[LoadRequest], events: list[threading.Event],
                   marks: list[Any], fence: Any) -> None:  # fmt: skip
        start = time.perf_counter()
        try:
            self.copier.follow(fence)
            self._load_batch(loads, events, marks)
        except Exception:  # never leave the forward waiting: every chunk of the batch fails
            logger.exception("kvpool: load batch failed")
            with self._lock:
                for req in loads:
                    self._load_failed(req)
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

    def _load_batch(self, loads: list[LoadRequest], events: list[threading.Event],
                    marks: list[Any]) -> None:  # fmt: skip
        """Keep every SSD busy (two waves in flight each) while resident chunks are copied."""
        pending = [_PendingRead(req, r, self.layout.nbytes(r.stored_blocks))
                   for req in loads for r in req.reads]  # fmt: skip
        queues: dict[int, deque[_PendingRead]] = defaultdict(deque)
        resident: list[_PendingRead] = []
        for p in pending:
            handler = self.tiers[p.read.device]
            if handler.failed:
                p.ok = False
            elif handler.resident:
                resident.append(p)
            else:
                p.segments = self._direct_segments(handler, p)
                queues[p.read.device].append(p)
        fits = all(sum(p.segments is None for p in q) <= self.tiers[d].staging_slots
                   for d, q in queues.items())  # fmt: skip
        layer_major = fits and any(not r.is_async for r in loads)
        if layer_major:  # verify now, scatter layer by layer once everything is here
            for p in resident:
                self._read_resident(p, scatter=False)
        host_queue: deque[_PendingRead] = deque()
        bulk: list[tuple[_PendingRead, np.ndarray]] = []
        for p in [] if layer_major else resident:
            ops = self._unverified_ops(p)
            if ops is None:
                host_queue.append(p)
            else:
                bulk.append((p, ops))
        # Unverified resident chunks (verified when saved, not on every fetch): one GIL-free copy
        # over all of them on ``copy_threads`` threads, on the copier, while this thread keeps the
        # SSDs busy. Verified ones are hashed and copied by this thread AND the copier, one chunk
        # each at a time (hashing, not memory, limits one thread).
        copier = None
        if bulk:
            copier = self._copier.submit(self._copy_resident, bulk)
        elif len(host_queue) > 1:
            copier = self._copier.submit(self._drain_resident, host_queue)
        inflight: dict[int, deque[_Wave]] = defaultdict(deque)
        last_done: dict[int, float] = {}
        while host_queue or any(queues.values()) or any(inflight.values()):
            progressed = False
            for d in list(queues):
                self._fill(d, queues[d], inflight[d], fits)
                while inflight[d] and self.tiers[d].poll(inflight[d][0].ticket):
                    self._finish_wave(d, inflight[d].popleft(), last_done, layer_major)
                    progressed = True
            if (p := _pop(host_queue)) is not None:
                self._read_resident(p, scatter=True, threads=1 if copier else self.copy_threads)
            elif not progressed:
                busy = [d for d in inflight if inflight[d]]
                if len(busy) == 1:  # one device left: sleep in the kernel until it is done
                    self._finish_wave(busy[0], inflight[busy[0]].popleft(), last_done, layer_major)
                else:
                    time.sleep(0.0002)
        if copier is not None:
            copier.result()
        if layer_major:
            plan = self.copier.prepare(self.layout, [(p.read, p.buf.view) for p in pending
                                                     if p.ok and p.buf is not None])  # fmt: skip
            for li, event in enumerate(events):
                marks[li] = self.copier.load_layer(self.layout, li, plan)
                event.set()
            self.copier.synchronize()  # before the staging buffers are reused
            self._release(pending)
        self.copier.synchronize()
        with self._lock:
            for p in pending:
                if not p.ok:
                    self._load_failed(p.req)
                    self._invalid_blocks.update(p.read.block_ids)

    def _load_failed(self, req: LoadRequest) -> None:
        if req.is_async:  # reported with its finish (``take_finished``); sync ones by blocks
            self._failed_loads.add(req.req_id)

    def _expected(self, r: ChunkRead) -> int | None:
        """The checksum a read must match (None: unverified). Bytes read from a device are
        always verified; a host-resident chunk was verified when it was saved, so only with
        ``verify_checksums`` (or a restored chunk's first read)."""
        if not self.tiers[r.device].resident or self.verify or r.verify:
            return r.checksums.get(self.rank)
        return None

    def _unverified_ops(self, p: _PendingRead) -> np.ndarray | None:
        """Copy rows of a resident chunk that needs no verification and goes to the KV whole."""
        r = p.read
        if self._expected(r) is not None or not self.layout.whole_read(r):
            return None
        p.buf = self.tiers[r.device].load_buffer(r.slot, p.nbytes)
        assert p.buf is not None  # resident media never run out of buffers
        return self._read_ops(r, p.buf.address)

    def _read_ops(self, r: ChunkRead, address: int) -> np.ndarray | None:
        """The C++ copy rows of a read from ``address``; None unless the KV is host memory the
        core can address (else the copier moves it, layer by layer)."""
        return self.layout.read_ops(r, address) if self.copier.kv_addressable else None

    def _copy_resident(self, chunks: list[tuple[_PendingRead, np.ndarray]]) -> None:
        start = time.perf_counter()
        self.io.copy_many(np.concatenate([ops for _, ops in chunks]), threads=self.copy_threads)
        elapsed = time.perf_counter() - start
        total = sum(p.nbytes for p, _ in chunks)
        with self._lock:
            for p, _ in chunks:  # one pass for all: each chunk's share of its time
                self._report.counters.device(self.tiers[p.read.device].name).count_read(
                    p.nbytes, elapsed * p.nbytes / total)

    def _direct_segments(self, handler: MediumHandler, p: _PendingRead) -> np.ndarray | None:
        """KV pages a full-chunk read can fill directly (CPU KV cache aligned for O_DIRECT)."""
        r = p.read
        if (not self.copier.kv_addressable or not self.layout.whole_read(r)
                or handler.io_length(p.nbytes) != p.nbytes):  # fmt: skip
            return None
        return self.layout.read_segments(r, handler.mem_alignment, handler.alignment)

    def _fill(self, device: int, queue: deque[_PendingRead], waves: deque[_Wave],
              fits: bool) -> None:  # fmt: skip
        """Submit reads until two waves are in flight or the staging buffers are all taken."""
        handler = self.tiers[device]
        if handler.failed:  # failed mid-batch: the rest of its reads are misses
            for p in queue:
                p.ok = False
            queue.clear()
            return
        wave_size = handler.staging_slots if fits else max(1, handler.staging_slots // 2)
        while queue and len(waves) < 2:
            wave: list[_PendingRead] = []
            ops = []
            staged = 0  # reads of this wave that take a staging buffer (direct ones do not)
            while queue and staged < wave_size:
                p = queue[0]
                target: Any = p.segments
                if target is None:
                    p.buf = handler.load_buffer(p.read.slot, p.nbytes)
                    if p.buf is None:
                        break  # staging busy (also used by saves): retry on the next round
                    staged += 1
                    target = p.buf.address
                queue.popleft()
                wave.append(p)
                expected = self._expected(p.read)
                ops.append(LoadOp(p.read.slot, target, p.nbytes, expected))
            if not wave:
                return
            try:
                waves.append(_Wave(handler.submit_load(ops), wave, time.perf_counter()))
            except OSError as exc:
                self._device_failed(device, str(exc))
                for p in (*wave, *queue):
                    p.ok = False
                self._release(wave)
                queue.clear()
                return

    def _finish_wave(self, device: int, wave: _Wave, last_done: dict[int, float],
                     layer_major: bool) -> None:  # fmt: skip
        handler = self.tiers[device]
        results = handler.wait(wave.ticket)
        now = time.perf_counter()
        # Waves overlap: charge the device only for the time since its previous completion.
        elapsed = now - max(wave.submitted, last_done.get(device, 0.0))
        last_done[device] = now
        good_bytes = 0
        corrupt_slots: list[int] = []
        counters = WorkerReport()
        c = counters.counters.device(handler.name)
        for p, r in zip(wave.reads, results, strict=True):
            if r.ok:
                good_bytes += p.nbytes
                continue
            p.ok = False
            if r.status == "corrupt":
                c.corrupt += 1
                counters.corrupt.append(p.read.key)
                corrupt_slots.append(p.read.slot)
                logger.warning("kvpool: corrupt chunk on %s (recomputed): %s", handler.name,
                               r.message)  # fmt: skip
            else:
                self._device_failed(device, r.message)
        if corrupt_slots:  # its record must not offer the chunk again after a restart
            try:
                handler.retire(corrupt_slots)
            except OSError as exc:
                self._device_failed(device, str(exc))
        c.count_read(good_bytes, elapsed, sum(p.ok for p in wave.reads))
        counters.observations.append((device, good_bytes, elapsed))
        with self._lock:
            self._report.merge(counters)
        if not layer_major:
            for p in wave.reads:
                if p.ok and p.buf is not None:
                    self._scatter(p, self.copy_threads)
            self.copier.synchronize()  # before the staging buffers are reused
            self._release(wave.reads)

    def _scatter(self, p: _PendingRead, threads: int) -> None:
        """Copy a chunk buffer into its KV blocks, all layers in one pass where it can."""
        assert p.buf is not None
        r = p.read
        ops = self._read_ops(r, p.buf.address)
        if ops is not None:
            self.io.copy_many(ops, threads=threads)
            return
        plan = self.copier.prepare(self.layout, [(r, p.buf.view)])
        for li in range(len(self.layout.layers)):
            self.copier.load_layer(self.layout, li, plan)

    def _drain_resident(self, chunks: deque[_PendingRead]) -> None:
        while (p := _pop(chunks)) is not None:
            self._read_resident(p, scatter=True, threads=1)

    def _read_resident(self, p: _PendingRead, scatter: bool, threads: int = 1) -> None:
        """Verify a resident chunk; with ``scatter``, copy it into the KV blocks in the same pass
        (a corrupt chunk's blocks are reported invalid and recomputed, so its bytes do no harm)."""
        handler = self.tiers[p.read.device]
        start = time.perf_counter()
        p.buf = handler.load_buffer(p.read.slot, p.nbytes)
        assert p.buf is not None  # resident media never run out of buffers
        r = p.read
        expected = self._expected(r)
        ops = None
        if scatter and expected is not None and self.layout.whole_read(r):
            # The whole chunk goes to the KV in byte order: hash it while it is copied.
            ops = self._read_ops(r, p.buf.address)
        if ops is not None:
            p.ok = self.io.copy_many_checksum(ops) == expected
        else:
            if expected is not None:
                (outcome,) = handler.wait(handler.submit_load(
                    [LoadOp(r.slot, p.buf.address, p.nbytes, expected)]))  # fmt: skip
                p.ok = outcome.ok
            if scatter and p.ok:
                self._scatter(p, threads)
        with self._lock:
            c = self._report.counters.device(handler.name)
            if p.ok:
                c.count_read(p.nbytes, time.perf_counter() - start)
            else:
                c.corrupt += 1
                self._report.corrupt.append(p.read.key)
                logger.warning("kvpool: corrupt chunk in host pool %s (recomputed)", handler.name)

    @staticmethod
    def _release(reads: list[_PendingRead]) -> None:
        for p in reads:
            if p.buf is not None:
                p.buf.release()
            p.buf = None

    # -- reporting -------------------------------------------------------------------------
    def take_finished(self, deferred_free: Sequence[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose deferred block free may happen now, finished async loads, those of
        them with a chunk that did not load: its blocks are in ``take_invalid_blocks`` too).

        ``deferred_free``: requests the scheduler newly kept alive for their saves; they are
        remembered until their last save is done. A load's failure is recorded before it
        finishes, so it is handed out with its finish and nothing piles up.
        """
        with self._lock:
            self._awaiting_free.update(deferred_free)
            sending = {r for r in self._awaiting_free if self._pending_saves.get(r, 0) == 0}
            self._awaiting_free -= sending
            recving, self._finished_loads = self._finished_loads, set()
            failed = recving & self._failed_loads
            self._failed_loads -= failed
        return sending, recving, failed

    def pending_saves(self, req_id: str) -> int:
        with self._lock:
            return self._pending_saves.get(req_id, 0)

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_report(self) -> WorkerReport:
        self._retry_failed()
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return out

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            for worker in (self._saver, self._loader, self._reaper, self._copier):
                worker.shutdown()
            self.copier.close()  # unregisters the host memory before the handlers free it
            for handler in self.tiers:
                handler.close()
