"""Pool metrics: per-device traffic and throughput, hit rate, evictions, per-request fetch time.

Workers count what they moved (``TransferCounters``) and ship it to the scheduler-side pool in
their step metadata; the scheduler adds lookups/evictions and publishes one ``PoolStatus``
(vLLM stats hook, ``kvpool status``, the usage plot).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DeviceCounters:
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0  # wall time of this device's reads (summed over batches)
    write_seconds: float = 0.0
    chunks_read: int = 0
    chunks_written: int = 0
    errors: int = 0
    corrupt: int = 0

    def add(self, other: DeviceCounters) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def count_read(self, nbytes: int, seconds: float, chunks: int = 1) -> None:
        self.bytes_read += nbytes
        self.read_seconds += seconds
        self.chunks_read += chunks

    def count_write(self, nbytes: int, seconds: float) -> None:
        self.bytes_written += nbytes
        self.write_seconds += seconds
        self.chunks_written += 1

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0


@dataclass
class TransferCounters:
    """What one worker moved since it last reported (mergeable across workers and steps)."""

    devices: dict[str, DeviceCounters] = field(default_factory=dict)
    fetch_seconds: list[float] = field(default_factory=list)  # one per finished request load

    def device(self, name: str) -> DeviceCounters:
        return self.devices.setdefault(name, DeviceCounters())

    def merge(self, other: TransferCounters) -> None:
        for name, counters in other.devices.items():
            self.device(name).add(counters)
        self.fetch_seconds.extend(other.fetch_seconds)

    def is_empty(self) -> bool:
        return not self.devices and not self.fetch_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"devices": {k: asdict(v) for k, v in self.devices.items()},
                "fetch_seconds": list(self.fetch_seconds)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferCounters:
        return cls({k: DeviceCounters(**v) for k, v in data.get("devices", {}).items()},
                   list(data.get("fetch_seconds", [])))  # fmt: skip


@dataclass
class LookupCounters:
    query_tokens: int = 0  # prompt tokens the pool was asked about
    hit_tokens: int = 0  # of those, served from the pool
    loads: int = 0
    saves: int = 0
    save_skipped_full: int = 0  # chunks not saved because nothing was evictable
    evictions: int = 0
    invalidated: int = 0  # corrupt / failed chunks dropped from the index
    restored: int = 0  # SSD chunks found again at start-up (a previous run's)
    restored_hits: int = 0  # chunk loads served from those
    moves_planned: int = 0  # stored chunks sent to another device (``migration``)
    moves_done: int = 0  # of those, now served from their new device
    moves_failed: int = 0  # a copy failed or the chunk was dropped meanwhile: it stayed

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class DeviceUsage:
    name: str
    kind: str
    used_slots: int
    total_slots: int
    slot_bytes: int
    weight_gbps: float  # the read estimate: measured GB/s, else the probe's (proposes the split)
    failed: bool
    probe_gbps: float = 0.0  # the probe's figure (the prior)
    measured_read_gbps: float | None = None  # bandwidth measured in service (``bandwidth``)
    measured_write_gbps: float | None = None
    kept_share: float | None = None  # its share of the split placement keeps (``split_guard``)

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.total_slots * self.slot_bytes


@dataclass
class PoolStatus:
    """A snapshot of the whole pool (what ``kvpool status`` prints)."""

    usage: list[DeviceUsage]
    lookups: LookupCounters
    transfers: TransferCounters
    placement: str
    chunk_tokens: int
    timestamp: float = field(default_factory=time.time)
    copies: int = 1  # copies of every slot's chunk: one per rank shard (``pools.shards``)

    @property
    def stored_bytes(self) -> int:
        """Bytes the pool's chunks take on all devices and all ranks' copies."""
        return sum(u.used_bytes for u in self.usage) * self.copies

    def to_dict(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp,
            "placement": self.placement,
            "chunk_tokens": self.chunk_tokens,
            "usage": [asdict(u) for u in self.usage],
            "lookups": asdict(self.lookups),
            "hit_rate": self.lookups.hit_rate,
            "transfers": self.transfers.to_dict(),
            "copies": self.copies,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolStatus:
        return cls(
            usage=[DeviceUsage(**u) for u in data["usage"]],
            lookups=LookupCounters(**data["lookups"]),
            transfers=TransferCounters.from_dict(data["transfers"]),
            placement=data["placement"],
            chunk_tokens=data["chunk_tokens"],
            timestamp=data["timestamp"],
            copies=data.get("copies", 1),
        )

    def write(self, path: str | os.PathLike) -> None:
        """Atomically replace ``path`` with this snapshot (readers never see half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".status-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | os.PathLike) -> PoolStatus:
        return cls.from_dict(json.loads(Path(path).read_text()))


def default_status_path() -> Path:
    return Path(tempfile.gettempdir()) / "kvpool" / "status.json"


def plot_usage(status: PoolStatus, path: str | os.PathLike, title: str = "") -> Path:
    """Bar chart per device: pool bytes used vs capacity, and bytes read (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [u.name for u in status.usage]
    used = [u.used_bytes / 2**30 for u in status.usage]
    cap = [u.capacity_bytes / 2**30 for u in status.usage]
    read = [status.transfers.devices.get(n, DeviceCounters()).bytes_read / 2**30 for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = range(len(names))
    ax1.bar(xs, cap, color="#dddddd", label="capacity")
    ax1.bar(xs, used, color="#3b7dd8", label="used")
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("GiB")
    ax1.set_title("pool usage per device")
    ax1.legend()
    ax2.bar(xs, read, color="#e07b39")
    for x, n in zip(xs, names, strict=True):
        gbps = status.transfers.devices.get(n, DeviceCounters()).read_gbps
        if gbps:
            ax2.annotate(f"{gbps:.1f} GB/s", (x, read[x]), ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("GiB read")
    ax2.set_title("fetched per device")
    fig.suptitle(title or f"kvpool ({status.placement} placement, hit rate "
                          f"{status.lookups.hit_rate:.0%})")  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def flat_counters(status: PoolStatus) -> dict[str, float]:
    """Cumulative counters as one flat dict (what goes through vLLM's stats hook)."""
    out: dict[str, float] = {
        "query_tokens": status.lookups.query_tokens,
        "hit_tokens": status.lookups.hit_tokens,
        "evictions": status.lookups.evictions,
        "saves": status.lookups.saves,
        "invalidated": status.lookups.invalidated,
        "fetch_count": len(status.transfers.fetch_seconds),
        "fetch_seconds_sum": sum(status.transfers.fetch_seconds),
    }
    for name, c in status.transfers.devices.items():
        out[f"bytes_read:{name}"] = c.bytes_read
        out[f"read_seconds:{name}"] = c.read_seconds
        out[f"bytes_written:{name}"] = c.bytes_written
    return out


GAUGE = "gauge:"  # a stats key whose latest value holds (not summed over intervals)


def flat_gauges(status: PoolStatus) -> dict[str, float]:
    """Each device's read bandwidth: the probe's figure and, once learned, the one measured in
    service (``bandwidth``), and its share of the split placement keeps (``split_guard``), for
    vLLM's stats hook beside the counters."""
    out: dict[str, float] = {}
    for u in status.usage:
        out[f"{GAUGE}probe_GBps:{u.name}"] = u.probe_gbps
        if u.measured_read_gbps is not None:
            out[f"{GAUGE}measured_GBps:{u.name}"] = u.measured_read_gbps
        if u.kept_share is not None:
            out[f"{GAUGE}kept_share:{u.name}"] = u.kept_share
    return out


def counter_delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def reduce_counters(data: dict[str, float]) -> dict[str, float]:
    """Interval summary for vLLM's logger: hit rate, GB/s per device, mean fetch time."""
    out: dict[str, float] = {}
    if data.get("query_tokens"):
        out["hit_rate"] = round(data.get("hit_tokens", 0) / data["query_tokens"], 4)
    for key in ("hit_tokens", "evictions", "saves", "invalidated"):
        if data.get(key):
            out[key] = data[key]
    if data.get("fetch_count"):
        out["fetch_ms_mean"] = round(1e3 * data["fetch_seconds_sum"] / data["fetch_count"], 2)
    for key, value in data.items():
        if key.startswith(GAUGE):
            out[key.removeprefix(GAUGE)] = round(value, 2)
        elif key.startswith("bytes_read:") and value:
            name = key.split(":", 1)[1]
            out[f"read_GiB:{name}"] = round(value / 2**30, 3)
            secs = data.get(f"read_seconds:{name}", 0)
            if secs > 0:
                out[f"read_GBps:{name}"] = round(value / secs / 1e9, 2)
    return out
