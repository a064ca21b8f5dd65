"""Host-memory medium: one ``_kvio.HostPool`` (one per NUMA node) holding the chunks themselves.

Saves gather straight into the chunk's slot and are done once checksummed; loads need no I/O
(``resident``): the engine verifies and copies a chunk into the KV in one pass
(``copy_many_checksum``). Chunks here do not survive a restart.

The ``host`` medium: no entry fields beyond the common ones (``numa_node`` places the pool).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from vllm_kvpool.config import DeviceConfig, PoolConfig, PoolConfigError
from vllm_kvpool.handlers.base import Buffer, LoadOp, MediumHandler, Outcome, SaveOp
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.media import Medium, register_medium
from vllm_kvpool.native import kvio

logger = logging.getLogger("vllm_kvpool")


class HostMemoryHandler(MediumHandler):
    resident = True

    def __init__(self, cfg: DeviceConfig, slot_bytes: int, num_slots: int,
                 pool: Any = None) -> None:  # fmt: skip
        """``pool``: an existing ``HostPool`` of at least ``num_slots`` slots (the pool
        service's shared memory, attached); default a private one of this process."""
        super().__init__(cfg, slot_bytes)
        self.io = kvio()
        self.pool = pool if pool is not None else self.io.HostPool(
            num_slots * slot_bytes, numa_node=cfg.numa_node, name=cfg.name)  # fmt: skip
        if self.pool.capacity < num_slots * slot_bytes:
            raise ValueError(f"host pool {cfg.name}: {self.pool.capacity} bytes hold fewer than "
                             f"{num_slots} slots of {slot_bytes}")  # fmt: skip
        if self.pool.note:
            logger.info("kvpool: host pool %s: %s", cfg.name, self.pool.note)
        self._bytes = torch.frombuffer(self.pool, dtype=torch.uint8)
        self._retired: list[Any] = []

    def adopt(self, pool: Any) -> None:
        """Serve from another (attached) pool from now on: the pool service restarted with new
        shared memory. The old mapping stays alive: a copy in flight may still read it."""
        self._retired.append(self.pool)
        self.pool = pool
        self._bytes = torch.frombuffer(self.pool, dtype=torch.uint8)
        self._new_host_region(pool.address, pool.capacity)

    def address(self, slot: int) -> int:
        return self.pool.address + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The chunk's bytes in the pool (uint8, zero copy)."""
        start = slot * self.slot_bytes
        return self._bytes[start : start + nbytes]

    def host_regions(self) -> list[tuple[int, int]]:
        return [(self.pool.address, self.pool.capacity)]

    def save_buffer(self, slot: int, nbytes: int) -> Buffer:
        return Buffer(self.view(slot, nbytes), self.address(slot))

    def submit_save(self, ops: Sequence[SaveOp]) -> int:
        return self._completed([Outcome(True, checksum=self.io.checksum(op.address, op.nbytes))
                                for op in ops])  # fmt: skip

    def load_buffer(self, slot: int, nbytes: int) -> Buffer:
        return Buffer(self.view(slot, nbytes), self.address(slot))

    def submit_load(self, ops: Sequence[LoadOp]) -> int:
        """Verify (and, for an address target elsewhere, copy) chunks held in this pool."""
        outcomes = []
        for op in ops:
            src = self.address(op.slot)
            if isinstance(op.target, int) and op.target != src:
                self.io.memcpy(op.target, src, op.nbytes)
            elif not isinstance(op.target, int):  # (addr, nbytes) segments
                rows, pos = [], src
                for addr, n in op.target:
                    rows.append((int(addr), pos, int(n)))
                    pos += int(n)
                self.io.copy_many(rows)
            if op.expected is None:
                outcomes.append(Outcome(True))
                continue
            got = self.io.checksum(src, op.nbytes)
            outcomes.append(Outcome(True, checksum=got) if got == op.expected else
                            Outcome(False, "corrupt", got, f"host pool {self.name}: chunk in "
                                    f"slot {op.slot} fails its checksum"))  # fmt: skip
        return self._completed(outcomes)

    def close(self) -> None:
        self._bytes = None
        self.pool = None
        self._retired = []


class HostMedium(Medium):
    name = "host"

    def open(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout,
             rank_suffix: str) -> HostMemoryHandler:  # fmt: skip
        return HostMemoryHandler(cfg, layout.slot_bytes, layout.num_slots(cfg))

    def probe(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout) -> float:
        """A memcpy of ``probe.size``."""
        # the memcpy is not bound to the node: without this a node the machine lacks was
        # probed (and shown as "numa N") where opening the pool refuses it
        if cfg.numa_node not in (nodes := kvio().numa_nodes()):
            raise PoolConfigError(f"devices[{config.devices.index(cfg)}].{cfg.kind}.numa_node",
                                  f"node {cfg.numa_node} does not exist on this machine (nodes "
                                  f"with memory: {', '.join(map(str, nodes))})")  # fmt: skip
        result = kvio().probe_memcpy(seconds=config.probe.seconds, nbytes=config.probe.size)
        return float(result["gbps"])


register_medium(HostMedium())
