"""File or block-device medium (an SSD): ``_kvio.Device`` with io_uring + O_DIRECT, or posix.

Every rank keeps its shard of every chunk in its own file (``<path>.rank<r>``; a block device
is shared as is). The device holds the data region (``num_slots`` slots) and, after it, a
scratch region for the bandwidth probe. Reads and writes go through registered staging buffers
(one slot each) or, for reads, straight into KV pages (``LoadOp.target`` as segments).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_kvpool.config import DeviceConfig
from vllm_kvpool.handlers.base import Buffer, LoadOp, MediumHandler, Outcome, SaveOp, StagingSlots
from vllm_kvpool.native import kvio

logger = logging.getLogger("vllm_kvpool")
PROBE_RESERVE = 64 * 2**20  # bytes after the data region, scratch space for probe_device


def device_path(cfg: DeviceConfig, rank_suffix: str) -> str:
    """Each worker rank keeps its own shard of every chunk in its own file."""
    assert cfg.path is not None
    if not rank_suffix or cfg.path.startswith("/dev/"):
        return cfg.path
    return f"{cfg.path}{rank_suffix}"


class DeviceHandler(MediumHandler):
    """A file or block device behind ``_kvio.Device`` (backend ``uring`` or ``posix``)."""

    def __init__(self, cfg: DeviceConfig, slot_bytes: int, num_slots: int, staging_bytes: int,
                 rank_suffix: str = "") -> None:  # fmt: skip
        super().__init__(cfg, slot_bytes)
        self.io = kvio()
        self.num_slots = num_slots
        self.rank_suffix = rank_suffix
        self.device, self.data_base = self.open_device()
        try:
            pool = self.io.HostPool(max(staging_bytes // slot_bytes, 2) * slot_bytes,
                                    numa_node=cfg.numa_node, name=f"{cfg.name}-staging")  # fmt: skip
            self.staging = StagingSlots(pool, slot_bytes)
            self.device.register_host_pools([pool])
        except Exception:
            self.device.close()
            raise
        if self.device.note:
            logger.info("kvpool: device %s: %s", cfg.name, self.device.note)
        self._staging_bytes = torch.frombuffer(pool, dtype=torch.uint8)

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def target_of(cls, cfg: DeviceConfig, rank_suffix: str = "") -> str:
        """What ``_kvio.Device`` opens: this rank's file, or the block device."""
        return device_path(cfg, rank_suffix)

    @property
    def target(self) -> str:
        return self.target_of(self.cfg, self.rank_suffix)

    @classmethod
    def open_raw(cls, cfg: DeviceConfig, num_slots: int, slot_bytes: int, rank_suffix: str = "",
                 create: bool = True) -> tuple[Any, int]:  # fmt: skip
        """Open (creating/preallocating a file) and reserve the data region: (device, base)."""
        data_bytes = num_slots * slot_bytes
        dev = kvio().Device(cls.target_of(cfg, rank_suffix), capacity=data_bytes + PROBE_RESERVE,
                            backend=cfg.backend, queue_depth=cfg.queue_depth, name=cfg.name,
                            create=create)  # fmt: skip
        return dev, dev.alloc(data_bytes)

    def open_device(self, create: bool = True) -> tuple[Any, int]:
        return self.open_raw(self.cfg, self.num_slots, self.slot_bytes, self.rank_suffix, create)

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
        return self.device.submit_write([(self.offset(op.slot), op.address,
                                           self.io_length(op.nbytes)) for op in ops])  # fmt: skip

    def submit_load(self, ops: Sequence[LoadOp]) -> int:
        return self.device.submit_read([(self.offset(op.slot), op.target,
                                          self.io_length(op.nbytes), op.expected)
                                         for op in ops])  # fmt: skip

    def poll(self, ticket: int) -> bool:
        return self.device.poll(ticket)

    def wait(self, ticket: int) -> list[Outcome]:
        return [Outcome(r.ok, r.status, r.checksum, r.message)
                for r in self.device.wait(ticket, check=False)]  # fmt: skip

    # -- health ----------------------------------------------------------------------------
    def try_recover(self) -> bool:
        """Reopen the device and check a write/read round trip in the probe scratch region."""
        if not self.failed:
            return True
        try:
            dev, base = self.open_device(create=False)
        except OSError as exc:
            logger.debug("kvpool: %s still unavailable: %s", self.name, exc)
            return False
        try:
            self.io.probe_device(dev, seconds=0.05, chunk_bytes=max(self.alignment, 4096) * 16)
            dev.register_host_pools([self.staging.pool])
        except Exception as exc:  # noqa: BLE001 - any failure keeps the device out
            logger.debug("kvpool: %s still failing: %s", self.name, exc)
            dev.close()
            return False
        old, self.device, self.data_base = self.device, dev, base
        if not old.closed:
            old.close()
        with self._lock:
            self.failure = None
        logger.warning("kvpool: %s is back (reopened %s at %s)", self.name, self.target,
                       time.strftime("%H:%M:%S"))  # fmt: skip
        return True

    def close(self) -> None:
        if self.device is not None and not self.device.closed:
            self.device.close()
