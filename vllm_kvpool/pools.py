"""Where an engine's pool lives, decided by one config field: in this process (``UnifiedPool``
and media opened here, the default) or in the node's pool service (``service:``: a
``RemotePool`` and the service's shared host pools). The scheduler, the worker and ``LocalPool``
open theirs here."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.handlers import MediumHandler, open_handlers, restorable_chunks
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.placement import DeviceWeights
from vllm_kvpool.pool import UnifiedPool
from vllm_kvpool.probe import probe_bandwidths
from vllm_kvpool.service.remote import RemotePool, ServiceClient, attach_handlers

logger = logging.getLogger("vllm_kvpool")


def shards(config: PoolConfig, layout: ChunkLayout, world_size: int) -> int:
    """Copies of each chunk the pool keeps, one per rank that holds distinct KV: one for a
    replicated (MLA) layout when the ranks share the service's memory (rank 0 saves, every rank
    loads: 1/TP of the bytes), else one shard per rank (GQA heads are split over the ranks; an
    in-process pool's host memory is private to each rank)."""
    return 1 if layout.replicated and config.service is not None else world_size


def open_pool(config: PoolConfig, layout: ChunkLayout, world_size: int, engine: str,
              bandwidths: Sequence[float] | None = None) -> UnifiedPool | RemotePool:  # fmt: skip
    """The scheduler side's pool. In process: probed (or ``bandwidths``) placement weights and
    the chunks a previous run left on the SSDs; with a service, both are the service's."""
    if config.service is not None:
        return RemotePool(config, layout, world_size, engine)
    if bandwidths is None:
        gbps = probe_bandwidths(config, layout)
        logger.info("kvpool: placement weights (GB/s): %s", dict(
            zip((d.name for d in config.devices), gbps, strict=True)))  # fmt: skip
    else:
        gbps = list(bandwidths)
    pool = UnifiedPool(config, layout, DeviceWeights(gbps, config.probe.learn_after, config.probe.half_life),
                       world_size)  # fmt: skip
    for device, chunks in restorable_chunks(config, layout, world_size).items():
        if n := pool.restore(device, chunks):
            logger.info("kvpool: %s: %d chunks of a previous run restored (each verified on its "
                        "first read)", config.devices[device].name, n)  # fmt: skip
    return pool


def open_media(config: PoolConfig, layout: ChunkLayout, rank: int, world_size: int,
               engine: str) -> tuple[ServiceClient | None, list[MediumHandler]]:  # fmt: skip
    """A worker rank's handlers (and its service connection, None in process)."""
    if config.service is not None:
        return attach_handlers(config, layout, rank, world_size, engine)
    return None, open_handlers(config, layout, f".rank{rank}" if world_size > 1 else "")
