"""One handler per pool medium behind one save / load / poll interface (``base.MediumHandler``).

``open_handlers`` builds them for a pool config, in device order (the pool's device index is
the position in this list). A new medium is a new ``MediumHandler`` subclass registered in
``handler_class``.
"""

from __future__ import annotations

from vllm_kvpool.config import DeviceConfig, PoolConfig
from vllm_kvpool.handlers.base import (
    Buffer,
    LoadOp,
    MediumHandler,
    Outcome,
    SaveOp,
    StagingSlots,
)
from vllm_kvpool.handlers.device import DeviceHandler
from vllm_kvpool.handlers.host import HostMemoryHandler
from vllm_kvpool.handlers.spdk import SpdkHandler
from vllm_kvpool.persist import RestoredChunk
from vllm_kvpool.pool import PoolGeometry

__all__ = ["Buffer", "DeviceHandler", "HostMemoryHandler", "LoadOp", "MediumHandler", "Outcome",
           "SaveOp", "SpdkHandler", "StagingSlots", "handler_class", "open_handler",
           "open_handlers", "restorable_chunks"]  # fmt: skip


def handler_class(cfg: DeviceConfig) -> type[MediumHandler]:
    if cfg.kind == "host":
        return HostMemoryHandler
    return SpdkHandler if cfg.backend == "spdk" else DeviceHandler


def open_handler(cfg: DeviceConfig, config: PoolConfig, geometry: PoolGeometry,
                 rank_suffix: str = "") -> MediumHandler:  # fmt: skip
    """Allocate a host pool or open an SSD of the config (worker side)."""
    cls = handler_class(cfg)
    if issubclass(cls, HostMemoryHandler):
        return cls(cfg, geometry.slot_bytes, geometry.num_slots(cfg))
    assert issubclass(cls, DeviceHandler)
    return cls(cfg, geometry, config.staging, rank_suffix)


def open_handlers(config: PoolConfig, geometry: PoolGeometry,
                  rank_suffix: str = "") -> list[MediumHandler]:  # fmt: skip
    """Every member of the pool config, in device order; all closed again if one fails."""
    handlers: list[MediumHandler] = []
    try:
        for cfg in config.devices:
            handlers.append(open_handler(cfg, config, geometry, rank_suffix))
    except Exception:
        for h in handlers:
            h.close()
        raise
    return handlers


def restorable_chunks(config: PoolConfig, geometry: PoolGeometry,
                      world_size: int = 1) -> dict[int, list[RestoredChunk]]:  # fmt: skip
    """Per device index, the chunks a previous run left that this pool may serve (read from
    the media's index regions; host memory keeps nothing across a restart)."""
    out = {}
    for d, cfg in enumerate(config.devices):
        cls = handler_class(cfg)
        if issubclass(cls, DeviceHandler):
            out[d] = cls.restorable(cfg, geometry, world_size)
    return out
