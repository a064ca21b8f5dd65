"""SPDK medium: an NVMe namespace driven from user space (``_kvio.Device`` backend ``spdk``).

The same transfers and index records as a file or block device; it differs in what is opened
(the transport id, ``spdk_trid``, not a path), in durability (no kernel ``fdatasync``: records
follow completed data writes, but the namespace's volatile write cache is not flushed), and in
restart: the index region is not scanned at start-up (the scheduler cannot open the namespace
beside the worker), so SPDK chunks do not survive a restart yet.
"""

from __future__ import annotations

from vllm_kvpool.config import DeviceConfig
from vllm_kvpool.handlers.device import DeviceHandler
from vllm_kvpool.persist import RestoredChunk
from vllm_kvpool.pool import PoolGeometry


class SpdkHandler(DeviceHandler):
    @classmethod
    def target_of(cls, cfg: DeviceConfig, rank_suffix: str = "") -> str:
        assert cfg.spdk_trid is not None  # the config parser requires it for spdk
        return cfg.spdk_trid

    def open_sync_fd(self) -> int | None:
        return None

    @classmethod
    def restorable(cls, cfg: DeviceConfig, geometry: PoolGeometry,
                   world_size: int) -> list[RestoredChunk]:  # fmt: skip
        return []
