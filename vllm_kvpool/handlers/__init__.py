"""One handler per pool medium behind one save / load / poll interface (``base.MediumHandler``).

``open_handlers`` builds them for a pool config, in device order (the pool's device index is
the position in this list), each by its device's registered medium (``vllm_kvpool.media``).
Importing this package registers the built-in media, ``host`` and ``ssd``.
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
from vllm_kvpool.handlers.ssd import SsdSettings
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.media import medium_of
from vllm_kvpool.persist import RestoredChunk

__all__ = ["Buffer", "DeviceHandler", "HostMemoryHandler", "LoadOp", "MediumHandler", "Outcome",
           "SaveOp", "SpdkHandler", "SsdSettings", "StagingSlots", "open_handler",
           "open_handlers", "restorable_chunks"]  # fmt: skip


def open_handler(cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout,
                 rank_suffix: str = "") -> MediumHandler:  # fmt: skip
    """Open one device of the config on its medium (worker side)."""
    return medium_of(cfg).open(cfg, config, layout, rank_suffix)


def open_handlers(config: PoolConfig, layout: ChunkLayout,
                  rank_suffix: str = "") -> list[MediumHandler]:  # fmt: skip
    """Every member of the pool config, in device order; all closed again if one fails."""
    handlers: list[MediumHandler] = []
    try:
        for cfg in config.devices:
            handlers.append(open_handler(cfg, config, layout, rank_suffix))
    except Exception:
        for h in handlers:
            h.close()
        raise
    return handlers


def restorable_chunks(config: PoolConfig, layout: ChunkLayout,
                      world_size: int = 1) -> dict[int, list[RestoredChunk]]:  # fmt: skip
    """Per device index, the chunks a previous run left that this pool may serve (media that
    keep nothing across a restart, like host memory, have no entry)."""
    out = {}
    for d, cfg in enumerate(config.devices):
        if chunks := medium_of(cfg).restore(cfg, layout, world_size):
            out[d] = chunks
    return out
