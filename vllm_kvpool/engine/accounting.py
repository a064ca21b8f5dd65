"""What the engine tells the scheduler, under one lock; every outcome is recorded here, once.

A save's outcome (committed with its checksum, or failed), a transfer's reads (bytes and time
per device, corrupt chunks), the loads that did not complete (their blocks recomputed), device
failures and recoveries, finished loads and the deferred block frees they allow.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvpool.protocol import ChunkRead, ChunkSave, LoadRequest, WorkerReport

logger = logging.getLogger("vllm_kvpool")


@dataclass(frozen=True)
class ReadOutcome:
    """One chunk read of a transfer: ``status`` "ok" | "corrupt" | "error" (the handler's)."""

    read: ChunkRead
    nbytes: int
    status: str
    message: str = ""


class Accounts:
    """The engine's report to the scheduler and the per-request state behind ``take_finished``."""

    def __init__(self, rank: int, device_names: Sequence[str]) -> None:
        self.rank = rank
        self._names = list(device_names)
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._pending_saves: dict[str, int] = defaultdict(int)
        self._finished_loads: set[str] = set()
        self._awaiting_free: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._failed_loads: set[str] = set()  # async loads with a chunk that did not load

    # -- saves -----------------------------------------------------------------------------
    def saves_started(self, jobs: Sequence[ChunkSave]) -> None:
        with self._lock:
            for job in jobs:
                self._pending_saves[job.req_id] += 1

    def save_done(self, job: ChunkSave, nbytes: int, checksum: int | None, error: str | None,
                  elapsed: float = 0.0) -> None:  # fmt: skip
        """A save's outcome: committed with its checksum, or failed (``checksum`` None);
        ``elapsed``: its share of the device's busy time (measured for ``bandwidth``)."""
        name = self._names[job.device]
        with self._lock:
            if checksum is None:
                self._report.failed_saves.append(job.key)
            else:
                self._report.committed.append((job.key, self.rank, checksum))
                self._report.counters.device(name).count_write(nbytes, elapsed)
                if elapsed > 0:
                    self._report.observations.append((job.device, "write", nbytes, elapsed))
            self._pending_saves[job.req_id] -= 1
            if self._pending_saves[job.req_id] <= 0:
                del self._pending_saves[job.req_id]
        if error and checksum is None:
            logger.warning("kvpool: save of a chunk to %s failed: %s", name, error)

    # -- moves -----------------------------------------------------------------------------
    def move_done(self, key: bytes, copied: bool) -> None:
        """A background copy of a chunk to its new slot finished (``copied``) or failed."""
        with self._lock:
            self._report.moved.append((key, self.rank, copied))

    # -- loads -----------------------------------------------------------------------------
    def reads_done(self, device: int, outcomes: Sequence[ReadOutcome], seconds: float) -> None:
        """One transfer's reads from ``device``: the good bytes counted as read in ``seconds``
        of the device's busy time (also measured for the placement weights, ``bandwidth``),
        corrupt chunks reported (the scheduler drops them). A failed read's blocks go through
        ``loads_failed``."""
        name = self._names[device]
        good = [o for o in outcomes if o.status == "ok"]
        good_bytes = sum(o.nbytes for o in good)
        with self._lock:
            c = self._report.counters.device(name)
            c.count_read(good_bytes, seconds, len(good))
            for o in outcomes:
                if o.status == "corrupt":
                    c.corrupt += 1
                    self._report.corrupt.append(o.read.key)
            if seconds > 0:
                self._report.observations.append((device, "read", good_bytes, seconds))
        for o in outcomes:
            if o.status == "corrupt":
                logger.warning("kvpool: corrupt chunk on %s (recomputed)%s", name,
                               f": {o.message}" if o.message else "")  # fmt: skip

    def loads_failed(self, failed: Sequence[tuple[LoadRequest, ChunkRead]]) -> None:
        """Reads that did not put their chunk into the KV: vLLM recomputes their blocks (an
        async load is reported failed with its finish, a sync one by its blocks)."""
        with self._lock:
            for req, read in failed:
                self._invalid_blocks.update(read.block_ids)
                if req.is_async:
                    self._failed_loads.add(req.req_id)

    def loads_finished(self, loads: Sequence[LoadRequest], seconds: float) -> None:
        with self._lock:
            for req in loads:
                self._report.counters.fetch_seconds.append(seconds)
                if req.is_async:
                    self._finished_loads.add(req.req_id)

    # -- devices ---------------------------------------------------------------------------
    def device_failed(self, device: int, reason: str) -> None:
        with self._lock:
            self._report.failed_devices[device] = reason
            self._report.counters.device(self._names[device]).errors += 1

    def device_recovered(self, device: int) -> None:
        with self._lock:
            self._report.failed_devices.pop(device, None)
            self._report.recovered_devices.append(device)

    # -- taking ----------------------------------------------------------------------------
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

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_report(self) -> WorkerReport:
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return out
