"""The interface every pool medium implements: save, load, poll/wait, health.

A handler owns one pool member (a host-memory pool, a file or block device, an SPDK namespace)
cut into fixed-size chunk slots. The engine schedules; handlers move bytes:

    buf = h.save_buffer(slot, nbytes)             # memory the KV gather fills
    t = h.submit_save([SaveOp(slot, buf.address, nbytes)])
    [outcome] = h.wait(t)                         # .ok, .checksum (XXH3-64 of the chunk)
    target = h.load_buffer(slot, nbytes)          # None while staging is busy
    t = h.submit_load([LoadOp(slot, target.address, nbytes, expected_checksum)])
    h.poll(t); h.wait(t)                          # .status "ok" | "corrupt" | "error"

A ``resident`` medium keeps chunks in addressable memory (``view``/``address``): its loads need
no I/O, so the engine verifies and copies such chunks into the KV in one pass instead. A handler
that hits an I/O error is marked failed (its chunks become misses upstream) and may come back
through ``try_recover``.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_kvpool.config import DeviceConfig


@dataclass(frozen=True)
class Outcome:
    """Result of one op of a ticket, in op order."""

    ok: bool
    status: str = "ok"  # "ok" | "corrupt" | "error"
    checksum: int = 0  # XXH3-64 of the bytes written (saves) or verified (loads); 0 if none
    message: str = ""


@dataclass(frozen=True)
class SaveOp:
    slot: int
    address: int  # host memory holding the chunk's bytes (from ``save_buffer``)
    nbytes: int
    block_hashes: tuple[bytes, ...] = ()  # the chunk's blocks: persistent media index them


@dataclass(frozen=True)
class LoadOp:
    slot: int
    target: int | np.ndarray  # an address, or (kv_addr, nbytes) rows of a direct read
    nbytes: int
    expected: int | None  # checksum to verify, None = unverified


@dataclass
class Buffer:
    """Host memory a transfer reads from or writes into; ``release`` gives it back."""

    view: torch.Tensor  # uint8, exactly the chunk's bytes
    address: int
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


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


class MediumHandler(ABC):
    """One pool member behind the save / load / poll interface (see the module docstring)."""

    resident = False  # chunks live in addressable memory: loads need no I/O

    def __init__(self, cfg: DeviceConfig, slot_bytes: int) -> None:
        self.cfg = cfg
        self.slot_bytes = slot_bytes
        self.failure: str | None = None  # why the medium failed; None while healthy
        self._lock = threading.Lock()
        self._done: dict[int, list[Outcome]] = {}  # tickets completed at submit
        self._tickets = itertools.count(1)
        self._region_watchers: list[Callable[[int, int], None]] = []

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def mark_failed(self, reason: str) -> bool:
        """Record a failure; True the first time (the caller reports it once)."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = reason
            return first

    def try_recover(self) -> bool:
        """Bring a failed medium back if it works again; True when it is healthy now."""
        return not self.failed

    # -- geometry --------------------------------------------------------------------------
    @property
    def alignment(self) -> int:
        """Offset/length granularity of this medium's I/O (1 = none)."""
        return 1

    @property
    def mem_alignment(self) -> int:
        """Host-address granularity a direct read into KV memory needs (1 = none)."""
        return 1

    @property
    def staging_slots(self) -> int:
        """Loads that can hold a staging buffer at once (a wave's size bound)."""
        return 1 << 30

    def io_length(self, nbytes: int) -> int:
        align = max(self.alignment, 1)
        return -(-nbytes // align) * align

    # -- transfers -------------------------------------------------------------------------
    @abstractmethod
    def save_buffer(self, slot: int, nbytes: int) -> Buffer:
        """Host memory to gather a chunk into before ``submit_save``."""

    @abstractmethod
    def submit_save(self, ops: Sequence[SaveOp]) -> int:
        """Start writing chunks; the ticket's outcomes carry each chunk's checksum."""

    @abstractmethod
    def load_buffer(self, slot: int, nbytes: int) -> Buffer | None:
        """Memory a load of ``slot`` lands in, or None while no staging buffer is free."""

    @abstractmethod
    def submit_load(self, ops: Sequence[LoadOp]) -> int:
        """Start reading chunks into their targets (verified when ``expected`` is given)."""

    def poll(self, ticket: int) -> bool:
        """Whether every op of ``ticket`` finished (non-consuming)."""
        return ticket in self._done

    def wait(self, ticket: int) -> list[Outcome]:
        """Outcomes of ``ticket`` in op order (consumes it)."""
        return self._done.pop(ticket)

    def _completed(self, outcomes: list[Outcome]) -> int:
        ticket = next(self._tickets)
        self._done[ticket] = outcomes
        return ticket

    def host_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the host memory loads are copied to the KV from (a device
        copier pins it once, ``device_copy``)."""
        return []

    def watch_host_regions(self, callback: Callable[[int, int], None]) -> None:
        """``callback(address, nbytes)`` for every host region this medium maps from now on
        (a pool service that restarted hands out new shared memory: a GPU copier pins it)."""
        self._region_watchers.append(callback)

    def _new_host_region(self, address: int, nbytes: int) -> None:
        for callback in self._region_watchers:
            callback(address, nbytes)

    def retire(self, slots: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Forget ``slots`` durably (persistent media erase their index records)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the medium (waits for its I/O)."""
