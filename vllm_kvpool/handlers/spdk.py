"""SPDK medium: an NVMe namespace driven from user space (``_kvio.Device`` backend ``spdk``).

The same transfers and index records as a file or block device; it differs in what is opened
(the transport id, ``spdk_trid``, not a path), in durability (no kernel ``fdatasync``: records
follow completed data writes, but the namespace's volatile write cache is not flushed), and in
restart: the index region is not scanned at start-up (the scheduler cannot open the namespace
beside the worker), so SPDK chunks do not survive a restart yet.

A lost NVMe-oF connection is handled inside the engine: in-flight I/O fails
(``DeviceUnavailableError``), the engine marks this medium failed (its chunks become misses),
the controller reconnects by itself and ``Device.state`` returns to ``"ok"``; ``try_recover``
then checks a verified round trip before the pool uses the device again.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvpool.config import DeviceConfig
from vllm_kvpool.handlers.device import PROBE_CHUNK, DeviceHandler, ssd_settings
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.native import kvio
from vllm_kvpool.persist import RestoredChunk

logger = logging.getLogger("vllm_kvpool")


class SpdkHandler(DeviceHandler):
    # Over PCIe the controller DMAs into the registered pools, which must then be hugetlb pages
    # (the engine refuses others with a ValueError naming the pool); NVMe-oF accepts any.
    records_hugepages = True

    @classmethod
    def target_of(cls, cfg: DeviceConfig, rank_suffix: str = "") -> str:
        trid = ssd_settings(cfg).spdk_trid
        assert trid is not None  # the config parser requires it for spdk
        return trid

    @classmethod
    def probe_pool(cls, cfg: DeviceConfig, dev: Any) -> Any:
        """Registered (hugetlb) buffers: over PCIe the controller DMAs into nothing else."""
        pool = kvio().HostPool(PROBE_CHUNK * max(2, dev.queue_depth), numa_node=cfg.numa_node,
                               name=f"{cfg.name}-probe")  # fmt: skip
        dev.register_host_pools([pool])
        return pool

    def open_sync_fd(self) -> int | None:
        return None

    def starts_empty(self) -> bool:
        return False  # a namespace may hold a previous run's records

    @classmethod
    def restorable(cls, cfg: DeviceConfig, layout: ChunkLayout,
                   world_size: int) -> list[RestoredChunk]:  # fmt: skip
        return []

    def try_recover(self) -> bool:
        """Back once the engine reconnected the controller and a verified write/read of one
        staging slot through the probe scratch region (never live chunks) succeeds."""
        if not self.failed:
            return True
        if self.device.state != "ok":
            return False
        slots = self.staging.take(1, block=False)
        if not slots:
            return False
        scratch = None
        try:
            nbytes = self.io_length(min(self.slot_bytes, 1 << 20))
            scratch = self.device.alloc(nbytes)
            addr = self.staging.address(slots[0])
            [w] = self.device.write([(scratch, addr, nbytes)])
            [r] = self.device.read([(scratch, addr, nbytes, w.checksum)])
            if not r.ok:
                return False
        except OSError as exc:
            logger.debug("kvpool: %s still failing: %s", self.name, exc)
            return False
        finally:
            if scratch is not None:
                self.device.free(scratch)
            self.staging.give(slots)
        with self._lock:
            self.failure = None
        logger.warning("kvpool: %s is back (controller reconnected %d time(s))", self.name,
                       self.device.stats()["reconnects"])
        return True
