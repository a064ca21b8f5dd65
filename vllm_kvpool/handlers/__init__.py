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
from vllm_kvpool.pool import PoolGeometry

__all__ = ["Buffer", "DeviceHandler", "HostMemoryHandler", "LoadOp", "MediumHandler", "Outcome",
           "SaveOp", "SpdkHandler", "StagingSlots", "handler_class", "open_handler",
           "open_handlers"]  # fmt: skip


def handler_class(cfg: DeviceConfig) -> type[MediumHandler]:
    if cfg.kind == "host":
        return HostMemoryHandler
    return SpdkHandler if cfg.backend == "spdk" else DeviceHandler


def open_handler(cfg: DeviceConfig, config: PoolConfig, geometry: PoolGeometry,
                 rank_suffix: str = "") -> MediumHandler:  # fmt: skip
    """Allocate a host pool or open an SSD of the config (worker side)."""
    cls = handler_class(cfg)
    slots = geometry.num_slots(cfg)
    if issubclass(cls, HostMemoryHandler):
        return cls(cfg, geometry.slot_bytes, slots)
    assert issubclass(cls, DeviceHandler)
    return cls(cfg, geometry.slot_bytes, slots, config.staging, rank_suffix)


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
