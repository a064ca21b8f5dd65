"""The messages between the scheduler-side pool and the worker-side engine (plain dataclasses).

Down (scheduler -> workers, once per step): chunk saves and loads. Up (workers -> scheduler):
a ``WorkerReport`` of committed writes, failures and traffic counters, mergeable across ranks.
No vLLM and no I/O here, so both sides (and tools without vLLM) share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvpool.metrics import TransferCounters


@dataclass(frozen=True)
class ChunkSave:
    req_id: str
    key: bytes
    device: int
    slot: int
    block_ids: tuple[int, ...]  # vLLM block ids of each section's stored blocks, section by section
    num_blocks: int  # blocks of the chunk (a sliding-window section stores fewer)
    block_hashes: tuple[bytes, ...] = ()  # the chunk's block hashes (indexed on SSDs)


@dataclass(frozen=True)
class ChunkRead:
    key: bytes
    device: int
    slot: int
    stored_blocks: int  # blocks in the stored chunk (its layout)
    checksums: dict[int, int]  # worker rank -> checksum of that rank's shard
    block_ids: tuple[int, ...]  # destination vLLM blocks, section by section
    # Per section of the stored chunk (``layout``): (skip, count): its blocks skip..skip+count
    # go to the next ``count`` of ``block_ids`` (skip: blocks vLLM already holds).
    sections: tuple[tuple[int, int], ...]
    verify: bool = False  # check the checksum even with verify_checksums off (restored chunk)


@dataclass(frozen=True)
class ChunkMove:
    """Copy a stored chunk to another device's slot (background migration, ``migration``):
    read from ``device``/``slot`` (verified against ``checksums``), written to
    ``dest_device``/``dest_slot`` with its index record (``block_hashes``); the chunk stays
    where it was until every rank reported its copy."""

    key: bytes
    device: int
    slot: int
    dest_device: int
    dest_slot: int
    num_blocks: int
    checksums: dict[int, int]  # worker rank -> checksum of that rank's shard
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class LoadRequest:
    req_id: str
    reads: tuple[ChunkRead, ...]
    is_async: bool


@dataclass
class WorkerReport:
    """What a worker tells the scheduler-side pool after a step (mergeable across ranks)."""

    committed: list[tuple[bytes, int, int]] = field(default_factory=list)  # key, rank, checksum
    failed_saves: list[bytes] = field(default_factory=list)
    corrupt: list[bytes] = field(default_factory=list)
    failed_devices: dict[int, str] = field(default_factory=dict)
    recovered_devices: list[int] = field(default_factory=list)  # failed, now working again
    # (device, "read" | "write", bytes, busy seconds): the bandwidth measured in service
    observations: list[tuple[int, str, int, float]] = field(default_factory=list)
    moved: list[tuple[bytes, int, bool]] = field(default_factory=list)  # key, rank, copied
    counters: TransferCounters = field(default_factory=TransferCounters)

    def merge(self, other: WorkerReport) -> WorkerReport:
        self.committed += other.committed
        self.failed_saves += other.failed_saves
        self.corrupt += other.corrupt
        self.failed_devices.update(other.failed_devices)
        self.recovered_devices += other.recovered_devices
        self.observations += other.observations
        self.moved += other.moved
        self.counters.merge(other.counters)
        return self

    def is_empty(self) -> bool:
        return not (self.committed or self.failed_saves or self.corrupt or self.failed_devices
                    or self.recovered_devices or self.observations or self.moved
                    or not self.counters.is_empty())  # fmt: skip
