"""The pool's devices as opened on one machine, on top of the C++ engine ``vllm_kvpool._kvio``.

A host tier is one ``HostPool`` (NUMA-bound, 2 MiB aligned) whose slots hold chunks directly.
An SSD tier is one ``Device`` (O_DIRECT io_uring / SPDK / posix) plus a staging ``HostPool`` on
its NUMA node, registered with the device, through which every chunk is read and written.
Slot ``s`` of an SSD lives at ``data_base + s * slot_bytes``; the region after the data is kept
free for the bandwidth probe so probing never touches live chunks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm_kvpool.config import DeviceConfig, PoolConfig
from vllm_kvpool.pool import PoolGeometry

logger = logging.getLogger("vllm_kvpool")

PROBE_RESERVE = 64 * 2**20  # bytes after the data region, scratch space for probe_device
PROBE_CHUNK = 2 * 2**20


def kvio() -> Any:
    """The C++ engine, imported on first use (keeps ``import vllm_kvpool`` light)."""
    try:
        from vllm_kvpool import _kvio
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise ImportError(
            "vllm_kvpool._kvio (the C++ I/O engine) is not built: run "
            "`pip install --no-build-isolation -e .` in the repository"
        ) from exc
    return _kvio


def device_path(cfg: DeviceConfig, rank_suffix: str) -> str:
    """Each worker rank keeps its own shard of every chunk in its own file."""
    assert cfg.path is not None
    if cfg.backend == "spdk" or not rank_suffix or cfg.path.startswith("/dev/"):
        return cfg.path
    return f"{cfg.path}{rank_suffix}"


@dataclass
class StagingSlots:
    """Fixed-size staging buffers in a HostPool, handed out to reads and writes in flight."""

    pool: Any  # _kvio.HostPool
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.free = list(range(self.pool.capacity // self.slot_bytes))

    @property
    def total(self) -> int:
        return self.pool.capacity // self.slot_bytes

    def address(self, slot: int) -> int:
        return self.pool.address + slot * self.slot_bytes

    def take(self, n: int, block: bool = True) -> list[int]:
        """Up to ``n`` slots; blocks until at least one is free when ``block``."""
        with self.cond:
            while block and not self.free:
                self.cond.wait()
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    def give(self, slots: list[int]) -> None:
        with self.cond:
            self.free.extend(slots)
            self.cond.notify_all()


@dataclass
class HostTier:
    cfg: DeviceConfig
    pool: Any  # _kvio.HostPool holding the chunks themselves
    slot_bytes: int

    def address(self, slot: int) -> int:
        return self.pool.address + slot * self.slot_bytes

    def close(self) -> None:
        self.pool = None


@dataclass
class SsdTier:
    cfg: DeviceConfig
    device: Any  # _kvio.Device
    data_base: int
    staging: StagingSlots
    slot_bytes: int

    def offset(self, slot: int) -> int:
        return self.data_base + slot * self.slot_bytes

    def io_length(self, nbytes: int) -> int:
        align = max(self.device.alignment, 1)
        return -(-nbytes // align) * align

    def close(self) -> None:
        if self.device is not None and not self.device.closed:
            self.device.close()


Tier = HostTier | SsdTier


def open_ssd(cfg: DeviceConfig, geometry: PoolGeometry, rank_suffix: str = "") -> tuple[Any, int]:
    """Open (creating/preallocating when a file) an SSD and reserve its data region."""
    io = kvio()
    data_bytes = geometry.num_slots(cfg) * geometry.slot_bytes
    path = device_path(cfg, rank_suffix)
    dev = io.Device(path, capacity=data_bytes + PROBE_RESERVE, backend=cfg.backend,
                    queue_depth=cfg.queue_depth, name=cfg.name)  # fmt: skip
    return dev, dev.alloc(data_bytes)


def open_tiers(config: PoolConfig, geometry: PoolGeometry, rank_suffix: str = "") -> list[Tier]:
    """Allocate every host pool and open every SSD of the config (worker side)."""
    io = kvio()
    slot = geometry.slot_bytes
    tiers: list[Tier] = []
    try:
        for cfg in config.devices:
            if cfg.kind == "host":
                pool = io.HostPool(geometry.num_slots(cfg) * slot, numa_node=cfg.numa_node,
                                   name=cfg.name)  # fmt: skip
                if pool.note:
                    logger.info("kvpool: host pool %s: %s", cfg.name, pool.note)
                tiers.append(HostTier(cfg, pool, slot))
                continue
            dev, base = open_ssd(cfg, geometry, rank_suffix)
            staging_bytes = max(config.staging // slot, 2) * slot
            staging = io.HostPool(staging_bytes, numa_node=cfg.numa_node,
                                  name=f"{cfg.name}-staging")  # fmt: skip
            dev.register_host_pools([staging])
            if dev.note:
                logger.info("kvpool: device %s: %s", cfg.name, dev.note)
            tiers.append(SsdTier(cfg, dev, base, StagingSlots(staging, slot), slot))
    except Exception:
        for t in tiers:
            t.close()
        raise
    return tiers


def probe_bandwidths(config: PoolConfig, geometry: PoolGeometry) -> list[float]:
    """Read bandwidth (GB/s) per device: fixed ``bandwidth_gbps`` or a short probe.

    Host pools are probed with a memcpy of ``probe.size``; SSDs with the engine's read/write
    probe in the scratch region after the data, so no live chunk is touched.
    """
    io = None
    gbps: list[float] = []
    for cfg in config.devices:
        if cfg.bandwidth_gbps is not None:
            gbps.append(cfg.bandwidth_gbps)
            continue
        if not config.probe.enabled:
            gbps.append(1.0)  # no probe and no figure: equal weights
            continue
        io = io or kvio()
        if cfg.kind == "host":
            result = io.probe_memcpy(seconds=config.probe.seconds, nbytes=config.probe.size)
            gbps.append(float(result["gbps"]))
            continue
        dev, _ = open_ssd(cfg, geometry)
        try:
            result = io.probe_device(dev, seconds=config.probe.seconds, chunk_bytes=PROBE_CHUNK)
        finally:
            dev.close()
        gbps.append(max(float(result["read_gbps"]), 1e-3))
    return gbps
