"""The protocol messages wrapped in vLLM's connector metadata / stats types.

``PoolStepMetadata`` goes down (scheduler -> workers, once per step), ``PoolWorkerMetadata`` up
(workers -> scheduler, merged across ranks by vLLM), ``KVPoolStats`` to vLLM's stats logger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvpool.metrics import GAUGE, reduce_counters
from vllm_kvpool.protocol import ChunkMove, ChunkSave, LoadRequest, WorkerReport


@dataclass
class PoolStepMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    deferred_free: list[str] = field(default_factory=list)  # finished, blocks kept for saves
    service_epoch: str = ""  # the pool service's run this step's jobs belong to ("": in process)
    moves: list[ChunkMove] = field(default_factory=list)  # background migration (``migration``)
    move_rate: float = 0.0  # bytes per second the moves may copy


@dataclass
class PoolWorkerMetadata(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PoolWorkerMetadata)
        self.report.merge(other.report)
        return self


@dataclass
class KVPoolStats(KVConnectorStats):
    """Counter deltas of one interval (see ``metrics.flat_counters``); summed across sources."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if key.startswith(GAUGE) else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_counters(self.data)

    def is_empty(self) -> bool:
        return not self.data
