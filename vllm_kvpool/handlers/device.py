"""File or block-device medium (an SSD): ``_kvio.Device`` with io_uring + O_DIRECT, or posix.

Every rank keeps its shard of every chunk in its own file (``<path>.rank<r>``; a block device
is shared as is). Device layout: the data region (``num_slots`` slots), the index region (one
record per slot, ``persist``), then scratch space for the bandwidth probe. Reads and writes go
through registered staging buffers (one slot each) or, for reads, straight into KV pages
(``LoadOp.target`` as segments).

Write order for a slot (crash consistency, ``persist``): the slot's old record is erased and made
durable before the new data may overwrite it; the new data is made durable before its record is
written. So at every instant an intact record on the device describes durable bytes that are
still in its slot, and a save completes only once its record is written (it survives a restart).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from vllm_kvpool.config import DeviceConfig
from vllm_kvpool.handlers.base import Buffer, LoadOp, MediumHandler, Outcome, SaveOp, StagingSlots
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.native import kvio
from vllm_kvpool.persist import (
    MAX_HASH_BYTES,
    ChunkRecord,
    RestoredChunk,
    merge_ranks,
    record_bytes,
    scan_records,
)

if TYPE_CHECKING:
    from vllm_kvpool.handlers.ssd import SsdSettings

logger = logging.getLogger("vllm_kvpool")
PROBE_RESERVE = 64 * 2**20  # bytes after the index region, scratch space for probe_device
PROBE_CHUNK = 2 * 2**20  # bytes per read/write of the bandwidth probe
RECORD_POOL = 2 * 2**20  # host buffer for index records being written


def ssd_settings(cfg: DeviceConfig) -> SsdSettings:
    """The ``ssd`` entry's own fields (the ``ssd`` medium opens these handlers only)."""
    return cast("SsdSettings", cfg.settings)


def device_path(cfg: DeviceConfig, rank_suffix: str) -> str:
    """Each worker rank keeps its own shard of every chunk in its own file."""
    path = ssd_settings(cfg).path
    if not rank_suffix or path.startswith("/dev/"):
        return path
    return f"{path}{rank_suffix}"


class DeviceHandler(MediumHandler):
    """A file or block device behind ``_kvio.Device`` (backend ``uring`` or ``posix``)."""

    records_hugepages = False  # the index-record buffer is small: no huge page for it

    def __init__(self, cfg: DeviceConfig, layout: ChunkLayout, staging_bytes: int,
                 rank_suffix: str = "") -> None:  # fmt: skip
        super().__init__(cfg, layout.slot_bytes)
        self.io = kvio()
        self.layout = layout
        self.num_slots = layout.num_slots(cfg)
        self.record_bytes = record_bytes(layout.blocks_per_chunk)
        self.rank_suffix = rank_suffix
        # 1 = the slot may have an index record on the device (unknown slots of a device that
        # held data count as recorded): it is erased before the slot is overwritten.
        self._recorded = bytearray(self.num_slots) if self.starts_empty() else \
            bytearray(b"\x01") * self.num_slots  # fmt: skip
        self.device, self.data_base, self.index_base = self.open_device()
        self._sync_fd: int | None = None
        try:
            pool = self.io.HostPool(max(staging_bytes // self.slot_bytes, 2) * self.slot_bytes,
                                    numa_node=cfg.numa_node, name=f"{cfg.name}-staging")  # fmt: skip
            self.staging = StagingSlots(pool, self.slot_bytes)
            self.records = self.io.HostPool(RECORD_POOL, numa_node=cfg.numa_node,
                                            hugepages=self.records_hugepages,
                                            name=f"{cfg.name}-index")  # fmt: skip
            self.device.register_host_pools([pool, self.records])
            self._sync_fd = self.open_sync_fd()
        except Exception:
            self.device.close()
            raise
        if self.device.note:
            logger.info("kvpool: device %s: %s", cfg.name, self.device.note)
        self._staging_bytes = torch.frombuffer(pool, dtype=torch.uint8)
        self._record_lock = threading.Lock()
        self._saves: dict[int, list[SaveOp]] = {}  # save tickets -> their ops (records to write)

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def target_of(cls, cfg: DeviceConfig, rank_suffix: str = "") -> str:
        """What ``_kvio.Device`` opens: this rank's file, or the block device."""
        return device_path(cfg, rank_suffix)

    @property
    def target(self) -> str:
        return self.target_of(self.cfg, self.rank_suffix)

    @staticmethod
    def regions(cfg: DeviceConfig, layout: ChunkLayout) -> tuple[int, int, int]:
        """(data bytes, index bytes, capacity to open): the data region starts at 0."""
        data = layout.num_slots(cfg) * layout.slot_bytes
        index = layout.num_slots(cfg) * record_bytes(layout.blocks_per_chunk)
        return data, index, data + index + PROBE_RESERVE

    @classmethod
    def open_raw(cls, cfg: DeviceConfig, layout: ChunkLayout, rank_suffix: str = "",
                 create: bool = True) -> tuple[Any, int, int]:  # fmt: skip
        """Open (creating/preallocating a file), reserve data and index: (device, data, index)."""
        data, index, capacity = cls.regions(cfg, layout)
        settings = ssd_settings(cfg)
        dev = kvio().Device(cls.target_of(cfg, rank_suffix), capacity=capacity,
                            backend=settings.backend, queue_depth=settings.queue_depth,
                            name=cfg.name, create=create,
                            **({"spdk_core_mask": settings.spdk_core_mask}
                               if settings.spdk_core_mask else {}))  # fmt: skip
        try:
            data_base, index_base = dev.alloc(data), dev.alloc(index)
            if (data_base, index_base) != (0, data):  # the scheduler finds records there
                raise OSError(f"kvpool: {cfg.name}: unexpected regions {data_base}, {index_base}")
        except Exception:
            dev.close()
            raise
        return dev, data_base, index_base

    @classmethod
    def probe_gbps(cls, cfg: DeviceConfig, layout: ChunkLayout, seconds: float) -> float:
        """Read GB/s of the engine's write/read probe in the scratch region after the index, so
        no live chunk is touched."""
        dev, _, _ = cls.open_raw(cfg, layout)
        pool = None  # a local, so it outlives the device it is registered with
        try:
            pool = cls.probe_pool(cfg, dev)
            result = kvio().probe_device(dev, seconds=seconds, chunk_bytes=PROBE_CHUNK, pool=pool)
        finally:
            dev.close()
        return max(float(result["read_gbps"]), 1e-3)

    @classmethod
    def probe_pool(cls, cfg: DeviceConfig, dev: Any) -> Any | None:
        """Registered host buffers the probe must use (None: the probe's own)."""
        return None

    def open_device(self, create: bool = True) -> tuple[Any, int, int]:
        return self.open_raw(self.cfg, self.layout, self.rank_suffix, create)

    def open_sync_fd(self) -> int | None:
        """A descriptor to make written data durable with (``fdatasync``)."""
        return os.open(self.target, os.O_RDONLY)

    def starts_empty(self) -> bool:
        """Whether the medium holds no index record yet (a file this open creates or that is
        empty); otherwise every slot's record is erased before the slot is first reused."""
        target = self.target
        return not target.startswith("/dev/") and (not os.path.exists(target)
                                                   or os.path.getsize(target) == 0)

    @classmethod
    def restorable(cls, cfg: DeviceConfig, layout: ChunkLayout,
                   world_size: int) -> list[RestoredChunk]:  # fmt: skip
        """Chunks a previous run left on this device (every rank's file), oldest first."""
        data, _, _ = cls.regions(cfg, layout)
        size = record_bytes(layout.blocks_per_chunk)
        per_rank = [scan_records(cls.target_of(cfg, f".rank{r}" if world_size > 1 else ""), data,
                                 layout.num_slots(cfg), size) for r in range(world_size)]  # fmt: skip
        return merge_ranks(per_rank, layout.layout_version, layout.num_slots(cfg),
                           layout.slot_bytes, layout.blocks_per_chunk)

    # -- geometry --------------------------------------------------------------------------
    @property
    def alignment(self) -> int:
        return self.device.alignment

    @property
    def mem_alignment(self) -> int:
        return self.device.mem_alignment

    @property
    def staging_slots(self) -> int:
        return self.staging.total

    def offset(self, slot: int) -> int:
        return self.data_base + slot * self.slot_bytes

    # -- buffers ---------------------------------------------------------------------------
    def _staged(self, slot: int, nbytes: int) -> Buffer:
        start = slot * self.slot_bytes
        return Buffer(self._staging_bytes[start : start + nbytes], self.staging.address(slot),
                      lambda: self.staging.give([slot]))  # fmt: skip

    def host_regions(self) -> list[tuple[int, int]]:
        return [(self.staging.pool.address, self.staging.pool.capacity)]

    def save_buffer(self, slot: int, nbytes: int) -> Buffer:
        if taken := self.staging.take(1, block=False):
            return self._staged(taken[0], nbytes)
        # Staging busy: a private aligned buffer, so a big step can never deadlock.
        spill = self.io.HostPool(self.slot_bytes, numa_node=self.cfg.numa_node, hugepages=False,
                                 name=f"{self.cfg.name}-spill")  # fmt: skip
        view = torch.frombuffer(spill, dtype=torch.uint8)[:nbytes]
        return Buffer(view, spill.address, lambda: None)  # the view keeps the spill alive

    def load_buffer(self, slot: int, nbytes: int) -> Buffer | None:
        taken = self.staging.take(1, block=False)
        return self._staged(taken[0], nbytes) if taken else None

    # -- transfers -------------------------------------------------------------------------
    def submit_save(self, ops: Sequence[SaveOp]) -> int:
        if bad := [op.slot for op in ops if not 0 <= op.slot < self.num_slots]:
            raise ValueError(f"device {self.name}: slot {bad[0]} is outside its {self.num_slots} "
                             "slots")  # fmt: skip
        self.retire([op.slot for op in ops])  # old records gone (durably) before new data lands
        ticket = self.device.submit_write([(self.offset(op.slot), op.address,
                                            self.io_length(op.nbytes)) for op in ops])  # fmt: skip
        self._saves[ticket] = list(ops)
        return ticket

    def submit_load(self, ops: Sequence[LoadOp]) -> int:
        return self.device.submit_read([(self.offset(op.slot), op.target,
                                          self.io_length(op.nbytes), op.expected)
                                         for op in ops])  # fmt: skip

    def poll(self, ticket: int) -> bool:
        return self.device.poll(ticket)

    def wait(self, ticket: int) -> list[Outcome]:
        outcomes = [Outcome(r.ok, r.status, r.checksum, r.message)
                    for r in self.device.wait(ticket, check=False)]  # fmt: skip
        ops = self._saves.pop(ticket, None)
        if ops is not None:
            outcomes = self._persist(ops, outcomes)
        return outcomes

    # -- the index -------------------------------------------------------------------------
    def make_durable(self) -> None:
        """Data written so far survives a crash or power loss once this returns."""
        if self._sync_fd is not None:
            os.fdatasync(self._sync_fd)

    def _persist(self, ops: list[SaveOp], outcomes: list[Outcome]) -> list[Outcome]:
        """Index the chunks whose data is written: data made durable first, then the records."""
        todo = [(i, op) for i, (op, o) in enumerate(zip(ops, outcomes, strict=True))
                if o.ok and op.block_hashes
                and all(0 < len(h) <= MAX_HASH_BYTES for h in op.block_hashes)]  # fmt: skip
        if not todo:
            return outcomes
        try:
            self.make_durable()
        except OSError as exc:
            msg = f"device {self.name}: fdatasync failed: {exc}"
            return [Outcome(False, "error", 0, msg) if o.ok else o for o in outcomes]
        seq = time.time_ns()
        records = [(op.slot, ChunkRecord(op.slot, op.block_hashes, len(op.block_hashes), op.nbytes,
                                         outcomes[i].checksum, self.layout.layout_version,
                                         seq + k, self.num_slots, self.slot_bytes).encode(
                                             self.record_bytes))
                   for k, (i, op) in enumerate(todo)]  # fmt: skip
        out = list(outcomes)
        for (i, _), error in zip(todo, self._write_records(records), strict=True):
            if error:  # the chunk is fine but would not survive a restart: fail it
                out[i] = Outcome(False, "error", 0, f"index record: {error}")
        return out

    def retire(self, slots: Sequence[int]) -> None:
        """Erase the index records of ``slots`` and make that durable before returning: called
        before a slot is overwritten (a crash between the new data and its record must not leave
        the old record pointing at new bytes) and for a chunk found corrupt. Raises OSError."""
        stale = [s for s in dict.fromkeys(slots) if self._recorded[s]]
        if not stale:
            return
        empty = bytes(self.record_bytes)
        errors = [e for e in self._write_records([(s, empty) for s in stale]) if e]
        if errors:
            raise OSError(f"device {self.name}: erasing index records failed: {errors[0]}")
        self.make_durable()
        for s in stale:
            self._recorded[s] = 0

    def _write_records(self, records: Sequence[tuple[int, bytes]]) -> list[str]:
        """Write ``(slot, record bytes)`` to the index region; per record "" or the error."""
        size, per_batch = self.record_bytes, RECORD_POOL // self.record_bytes
        errors: list[str] = []
        with self._record_lock:
            for start in range(0, len(records), per_batch):
                batch = records[start : start + per_batch]
                writes = []
                for k, (slot, raw) in enumerate(batch):
                    self._recorded[slot] = 1  # from now on it may be on the device, torn or not
                    self.records.view(k * size, size)[:] = raw
                    writes.append((self.index_base + slot * size, self.records.address + k * size,
                                   size))  # fmt: skip
                errors += ["" if r.ok else r.message
                           for r in self.device.write(writes, check=False)]  # fmt: skip
        return errors

    # -- health ----------------------------------------------------------------------------
    def try_recover(self) -> bool:
        """Reopen the device and check a write/read round trip in the probe scratch region."""
        if not self.failed:
            return True
        try:
            dev, data_base, index_base = self.open_device(create=False)
        except OSError as exc:
            logger.debug("kvpool: %s still unavailable: %s", self.name, exc)
            return False
        try:
            self.io.probe_device(dev, seconds=0.05, chunk_bytes=max(dev.alignment, 4096) * 16)
            dev.register_host_pools([self.staging.pool, self.records])
            sync_fd = self.open_sync_fd()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the device out
            logger.debug("kvpool: %s still failing: %s", self.name, exc)
            dev.close()
            return False
        old, old_fd = self.device, self._sync_fd
        self.device, self.data_base, self.index_base, self._sync_fd = dev, data_base, index_base, sync_fd
        if not old.closed:
            old.close()
        if old_fd is not None:
            os.close(old_fd)
        with self._lock:
            self.failure = None
        logger.warning("kvpool: %s is back (reopened %s)", self.name, self.target)
        return True

    def close(self) -> None:
        if self.device is not None and not self.device.closed:
            self.device.close()
        if self._sync_fd is not None:
            os.close(self._sync_fd)
            self._sync_fd = None
