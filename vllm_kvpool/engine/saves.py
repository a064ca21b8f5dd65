"""The save path: gather a step's chunks out of vLLM's KV on the saver thread (``save_layer``
only enqueues, so the forward never blocks), then write them to their media asynchronously;
the reaper thread waits for the writes. The scheduler keeps the source blocks until a save's
outcome is reported."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpool.engine.accounting import Accounts
from vllm_kvpool.engine.health import DeviceHealth
from vllm_kvpool.engine.threads import TaskThread
from vllm_kvpool.handlers import Buffer, MediumHandler, SaveOp
from vllm_kvpool.layout.kv import ChunkKV
from vllm_kvpool.protocol import ChunkSave


@dataclass
class _SaveBuffer:
    job: ChunkSave
    buf: Buffer


def sync_device(layout: ChunkKV) -> None:
    if layout.device.type == "cuda":
        torch.cuda.current_stream().synchronize()


class SavePath:
    def __init__(self, tiers: Sequence[MediumHandler], layout: ChunkKV, accounts: Accounts,
                 health: DeviceHealth, thread: TaskThread, reaper: TaskThread) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.accounts = accounts
        self.health = health
        self.thread = thread  # gathers and submits, in step order
        self.reaper = reaper  # waits for the writes
        self._last_done: dict[int, float] = {}  # device -> its last write completion (reaper's)
        self._step_buffers: Future | None = None
        self._step_layers: set[int] = set()

    def save_layer(self, saves: Sequence[ChunkSave], layer_name: str) -> None:
        """Enqueue the gather of one layer for this step's saves (never blocks the forward)."""
        if not saves or layer_name not in self.layout.index:
            return
        self._ensure_step_buffers(saves)
        li = self.layout.index[layer_name]
        self._step_layers.add(li)
        event = self._record_event()
        self.thread.submit(self._gather_layer, self._step_buffers, li, event)

    def finish_step(self, saves: Sequence[ChunkSave]) -> None:
        """Enqueue the rest of this step's saves: missing layers, checksum, device writes."""
        if not saves:
            return
        self._ensure_step_buffers(saves)
        missing = [i for i in range(len(self.layout.layers)) if i not in self._step_layers]
        event = self._record_event()
        for li in missing:
            self.thread.submit(self._gather_layer, self._step_buffers, li, event)
        copied = self.thread.submit(lambda: None)
        self.thread.submit(self._write_step, self._step_buffers)
        self._step_buffers, self._step_layers = None, set()
        if self.layout.hybrid:
            # Sliding-window groups free out-of-window blocks while the request runs, and the
            # next step may write them for another token: copy them out before returning.
            copied.result()

    def _ensure_step_buffers(self, saves: Sequence[ChunkSave]) -> None:
        if self._step_buffers is None:
            self.accounts.saves_started(saves)
            self._step_buffers = self.thread.submit(self._take_buffers, list(saves))

    def _record_event(self) -> Any:
        if self.layout.device.type == "cuda":
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
        sync_device(self.layout)
        by_device: dict[int, list[_SaveBuffer]] = defaultdict(list)
        for b in buffers:
            if self.tiers[b.job.device].failed:
                self._done(b, None, "device failed")
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
                self.health.failed(device, str(exc))
                for b in group:
                    self._done(b, None, str(exc))
                continue
            self.reaper.submit(self._reap_writes, device, ticket, group, start)

    def _reap_writes(self, device: int, ticket: int, group: list[_SaveBuffer],
                     start: float) -> None:  # fmt: skip
        results = self.tiers[device].wait(ticket)
        now = time.perf_counter()
        # Groups of one device overlap (one per step): charge each only for the time since the
        # device's previous completion, so the summed time is the device's busy time.
        elapsed = now - max(start, self._last_done.get(device, 0.0))
        self._last_done[device] = now
        errors = [r.message for r in results if not r.ok]
        if errors:
            self.health.failed(device, errors[0])
        for b, r in zip(group, results, strict=True):
            self._done(b, r.checksum if r.ok else None, r.message or None, elapsed / len(group))

    def _done(self, b: _SaveBuffer, checksum: int | None, error: str | None,
              elapsed: float = 0.0) -> None:  # fmt: skip
        b.buf.release()
        self.accounts.save_done(b.job, self.layout.save_bytes(b.job), checksum, error, elapsed)
