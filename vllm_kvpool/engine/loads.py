"""The load path: a step's loads issue every device's reads at once (two batched waves in flight
per SSD) into staging buffers or straight into the KV pages, while resident (host-memory)
chunks are verified and copied into the KV by the loader thread and a copy thread. When the
whole load fits the staging buffers and a load is synchronous it scatters layer by layer and
signals each layer, so ``wait_for_layer_load`` releases early layers first."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_kvpool.device_copy import Copier
from vllm_kvpool.engine.accounting import Accounts, ReadOutcome
from vllm_kvpool.engine.health import DeviceHealth
from vllm_kvpool.engine.threads import TaskThread, pop
from vllm_kvpool.handlers import Buffer, LoadOp, MediumHandler
from vllm_kvpool.layout.kv import ChunkKV
from vllm_kvpool.native import kvio
from vllm_kvpool.protocol import ChunkRead, LoadRequest

logger = logging.getLogger("vllm_kvpool")


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


BULK_BATCH_BYTES = 64 * 2**20  # host-share bytes one copy call takes (threads split it)


def _batches(chunks: list[_PendingRead], nbytes: int) -> list[list[_PendingRead]]:
    """Consecutive chunks in batches of at least ``nbytes`` (the last may be smaller)."""
    out: list[list[_PendingRead]] = [[]]
    size = 0
    for p in chunks:
        if size >= nbytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


class _Bulk:
    """The unverified host share of a load, in batches two threads take turns copying."""

    def __init__(self, batches: list[list[_PendingRead]]) -> None:
        self.chunks = [p for b in batches for p in b]
        self.batches = deque(batches)
        self.start = self.end = 0.0
        self._lock = threading.Lock()

    def take_one(self, path: LoadPath, threads: int = 1) -> bool:
        """Copy the next batch into the KV (False: none left)."""
        batch = pop(self.batches)
        if batch is None:
            return False
        begin = time.perf_counter()
        ops = path.layout.reads_ops([(p.read, p.buf.address) for p in batch if p.buf])
        assert ops is not None  # ``_copied_unverified`` checked each chunk has rows
        path.io.copy_many(ops, threads=threads)
        done = time.perf_counter()
        with self._lock:
            self.start = begin if not self.start else min(self.start, begin)
            self.end = max(self.end, done)
        return True


class LoadPath:
    def __init__(self, tiers: Sequence[MediumHandler], layout: ChunkKV, copier: Copier,
                 accounts: Accounts, health: DeviceHealth, loader: TaskThread,
                 copy_thread: TaskThread, rank: int, verify: bool, copy_threads: int) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.copier = copier
        self.accounts = accounts
        self.health = health
        self.loader = loader  # runs each step's load batch
        self.copy_thread = copy_thread  # resident chunks beside the loader
        self.rank = rank
        self.verify = verify  # also re-verify host-resident chunks on every fetch
        self.copy_threads = copy_threads
        self.io = kvio()
        self._layer_events: list[threading.Event] = []
        self._layer_marks: list[Any] = []  # the copier's per-layer marks of the sync load

    def start(self, loads: Sequence[LoadRequest]) -> None:
        """Issue this step's loads; sync ones release layers through ``wait_layer``."""
        if not loads:
            return
        sync = any(not r.is_async for r in loads)
        events = [threading.Event() for _ in self.layout.layers]
        marks: list[Any] = [None] * len(events)
        if sync:
            self._layer_events, self._layer_marks = events, marks
        self.loader.submit(self._run_loads, list(loads), events, marks, self.copier.fence())

    def wait_layer(self, layer_name: str) -> None:
        """Until layer ``layer_name`` of the sync load is issued; then the forward's stream
        waits for that layer's copies only (the copier's mark)."""
        li = self.layout.index.get(layer_name)
        if li is not None and self._layer_events:
            self._layer_events[li].wait()
            self.copier.wait(self._layer_marks[li])

    def wait_sync(self) -> None:
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
            self.accounts.loads_failed([(req, r) for req in loads for r in req.reads])
        finally:
            for e in events:
                e.set()
        self.accounts.loads_finished(loads, time.perf_counter() - start)

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
        bulk: list[_PendingRead] = []
        for p in [] if layer_major else resident:
            (bulk if self._copied_unverified(p) else host_queue).append(p)
        inflight: dict[int, deque[_Wave]] = defaultdict(deque)
        for d in list(queues):  # the SSDs start first: planning the host copy can wait for them
            self._fill(d, queues[d], inflight[d], fits)
        # Unverified resident chunks (verified when saved, not on every fetch): GIL-free copies
        # of batches of them on the copier, while this thread keeps the SSDs busy and copies
        # their waves; when it has nothing to wait for and a core is left, it copies batches
        # too. The copier's threads leave a core to this thread while SSD reads are in the load
        # (``copy_threads`` as many as the cores would make three threads fight over two cores:
        # the verified path below, two threads, had been faster). Verified chunks are hashed
        # and copied by this thread AND the copier, one chunk each at a time.
        copier = None
        shared = _Bulk(_batches(bulk, BULK_BATCH_BYTES)) if bulk else None
        cores = len(os.sched_getaffinity(0))
        bulk_threads = self.copy_threads
        if queues and bulk_threads >= cores:
            bulk_threads = max(1, cores - 1)
        helps = bulk_threads < cores
        if shared is not None:
            copier = self.copy_thread.submit(self._copy_bulk, shared, bulk_threads)
        elif len(host_queue) > 1:
            copier = self.copy_thread.submit(self._drain_resident, host_queue)
        last_done: dict[int, float] = {}
        while host_queue or any(queues.values()) or any(inflight.values()):
            progressed = False
            # While the copier's threads copy the host share, a wave is scattered on one thread:
            # more would only contend with them for the same cores.
            threads = 1 if copier is not None and not copier.done() else self.copy_threads
            for d in list(queues):
                self._fill(d, queues[d], inflight[d], fits)
                while inflight[d] and self.tiers[d].poll(inflight[d][0].ticket):
                    self._finish_wave(d, inflight[d].popleft(), last_done, layer_major, threads)
                    progressed = True
            if (p := pop(host_queue)) is not None:
                self._read_resident(p, scatter=True, threads=1 if copier else self.copy_threads)
            elif not progressed and helps and shared is not None and shared.take_one(self):
                pass  # copied a batch of the host share while the SSDs work
            elif not progressed:
                busy = [d for d in inflight if inflight[d]]
                if len(busy) == 1:  # one device left: sleep in the kernel until it is done
                    self._finish_wave(busy[0], inflight[busy[0]].popleft(), last_done,
                                      layer_major, threads)  # fmt: skip
                else:
                    time.sleep(0.0002)
        while helps and shared is not None and shared.take_one(self):
            pass  # the SSDs are done: help the copier finish the host share
        if copier is not None:
            copier.result()
        if shared is not None:
            self._account_bulk(shared)
        if layer_major:
            plan = self.copier.prepare(self.layout, [(p.read, p.buf.view) for p in pending
                                                     if p.ok and p.buf is not None])  # fmt: skip
            for li, event in enumerate(events):
                marks[li] = self.copier.load_layer(self.layout, li, plan)
                event.set()
            self.copier.synchronize()  # before the staging buffers are reused
            self._release(pending)
        self.copier.synchronize()
        self.accounts.loads_failed([(p.req, p.read) for p in pending if not p.ok])

    def _expected(self, r: ChunkRead) -> int | None:
        """The checksum a read must match (None: unverified). Bytes read from a device are
        always verified; a host-resident chunk was verified when it was saved, so only with
        ``verify_checksums`` (or a restored chunk's first read)."""
        if not self.tiers[r.device].resident or self.verify or r.verify:
            return r.checksums.get(self.rank)
        return None

    def _charged_bytes(self, p: _PendingRead) -> int:
        """The bytes a resident chunk's read is charged (its device's learned rate): a verified
        chunk is read whole to be hashed; an unverified one moves only what the KV takes (with
        HMA the chunks before a hit's end leave their sliding-window tails in the pool, and
        charging the stored chunk made a host pool's learned rate ~1.5x too high)."""
        return p.nbytes if self._expected(p.read) is not None else self.layout.read_bytes(p.read)

    def _copied_unverified(self, p: _PendingRead) -> bool:
        """Whether a resident chunk needs no verification and goes to the KV by the C++ copy
        (its buffer is then taken): such chunks are copied together, whole or partial. With HMA
        a hit's chunks before its end drop their sliding-window tails; when only whole chunks
        were batched, the copier took the last chunk alone and the loader copied the rest one
        by one (GPT-OSS-20B 32K from host memory, DEVELOPMENT: 0.132 -> 0.115 s a fetch)."""
        r = p.read
        if self._expected(r) is not None or not self.copier.kv_addressable:
            return False
        p.buf = self.tiers[r.device].load_buffer(r.slot, p.nbytes)
        assert p.buf is not None  # resident media never run out of buffers
        return True

    def _read_ops(self, r: ChunkRead, address: int) -> np.ndarray | None:
        """The C++ copy rows of a read from ``address``; None unless the KV is host memory the
        core can address (else the copier moves it, layer by layer)."""
        return self.layout.read_ops(r, address) if self.copier.kv_addressable else None

    def _copy_bulk(self, bulk: _Bulk, threads: int) -> None:
        """The copier's side: batches of the host share until none is left."""
        while bulk.take_one(self, threads):
            pass

    def _account_bulk(self, bulk: _Bulk) -> None:
        """The host share's reads, once: the busy time is from the first batch's start to the
        last one's end (batches copied at once by two threads are not charged twice). Every
        host pool in the share is charged the whole window: one copier moved them all, so
        each pool's rate is its bytes over that window and the rates add up to the copier's.
        (Charging each pool its byte share of the window gave every pool the copier's whole
        rate, so two pools counted it twice.) Each chunk is charged ``_charged_bytes``."""
        elapsed = bulk.end - bulk.start
        by_device: dict[int, list[ReadOutcome]] = defaultdict(list)
        for p in bulk.chunks:
            by_device[p.read.device].append(ReadOutcome(p.read, self._charged_bytes(p), "ok"))
        for device, outcomes in by_device.items():
            self.accounts.reads_done(device, outcomes, elapsed)

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
                self.health.failed(device, str(exc))
                for p in (*wave, *queue):
                    p.ok = False
                self._release(wave)
                queue.clear()
                return

    def _finish_wave(self, device: int, wave: _Wave, last_done: dict[int, float],
                     layer_major: bool, threads: int) -> None:  # fmt: skip
        handler = self.tiers[device]
        results = handler.wait(wave.ticket)
        now = time.perf_counter()
        # Waves overlap: charge the device only for the time since its previous completion.
        elapsed = now - max(wave.submitted, last_done.get(device, 0.0))
        last_done[device] = now
        outcomes = []
        corrupt_slots: list[int] = []
        for p, r in zip(wave.reads, results, strict=True):
            outcomes.append(ReadOutcome(p.read, p.nbytes, "ok" if r.ok else r.status, r.message))
            if r.ok:
                continue
            p.ok = False
            if r.status == "corrupt":
                corrupt_slots.append(p.read.slot)
            else:
                self.health.failed(device, r.message)
        if corrupt_slots:  # its record must not offer the chunk again after a restart
            try:
                handler.retire(corrupt_slots)
            except OSError as exc:
                self.health.failed(device, str(exc))
        self.accounts.reads_done(device, outcomes, elapsed)
        if not layer_major:
            # One copy over the whole wave: a chunk alone is too small to split over the copy
            # threads (``copy_many`` gives each thread several MiB), a wave is not.
            staged = [p for p in wave.reads if p.ok and p.buf is not None]
            rows = self.layout.reads_ops([(p.read, p.buf.address) for p in staged if p.buf]) \
                if self.copier.kv_addressable else None  # fmt: skip
            if rows is not None:
                self.io.copy_many(rows, threads=threads)
            else:
                for p in staged:
                    self._scatter(p, threads)
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
        while (p := pop(chunks)) is not None:
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
        self.accounts.reads_done(p.read.device, [ReadOutcome(p.read, self._charged_bytes(p),
                                                             "ok" if p.ok else "corrupt")],
                                 time.perf_counter() - start)  # fmt: skip

    @staticmethod
    def _release(reads: list[_PendingRead]) -> None:
        for p in reads:
            if p.buf is not None:
                p.buf.release()
            p.buf = None
