"""Host -> KV copies of a load, behind one interface per KV device type (``copier_for``).

The engine hands a copier a load's chunks once (``prepare``), then one layer at a time
(``load_layer``); the copier returns a mark per layer that ``wait`` turns into "the forward may
read this layer" (vLLM's ``wait_for_layer_load``). Host memory the copies read from (host pools, SSD staging buffers) is
registered once (``register_host``) and unregistered on ``close``.

- ``Copier`` (KV caches in host memory, and any device without its own copier): each chunk's
  layer is copied by ``GroupKV.scatter`` (on CPU the C++ core's GIL-free ``copy_many``), the
  CPU path as it always was.
- ``DeviceCopier``: the KV lives on an accelerator. Per KV cache group it plans the load once
  (``block_runs``, ``stage_pays``); per layer that is one host-to-device copy per contiguous
  run of KV pages or, when the runs are short, one copy per chunk into a device staging buffer
  and one gather kernel (``index_copy_``). The copies go on a side stream; a device event per layer is the
  mark, so the forward's stream waits for exactly that layer, not the whole load. Subclasses
  supply only the device calls (``CudaCopier``; tests use a fake device on CPU tensors).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvpool.layout.kv import ChunkKV, GroupKV
from vllm_kvpool.protocol import ChunkRead

logger = logging.getLogger("vllm_kvpool")

# Below this mean run length a layer is staged and gathered: one DMA per chunk plus one kernel
# beats many small DMAs (each costs a few microseconds of driver and copy-engine setup).
SHORT_RUN_BYTES = 256 << 10
# host memory is registered in pieces of this size: pinning a pool of tens of GiB in one
# cudaHostRegister call blocks for seconds and, where the driver or RLIMIT_MEMLOCK refuses the
# whole, pins nothing; pieces pin what they can and each one that fails stays pageable
REGISTER_PIECE_BYTES = 1 << 30

LoadReads = Sequence[tuple[ChunkRead, torch.Tensor]]  # (read, the chunk's host bytes)


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``ids``, first block, blocks) of each run of consecutive block ids: each
    run is one contiguous slice of every layer's KV pages, so one copy."""
    a = np.asarray(ids, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(a)]))
    return [(int(s), int(a[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def stage_pays(runs: int, reads: int, nbytes: int, short_run_bytes: int = SHORT_RUN_BYTES) -> bool:
    """Whether one staged copy per read plus one gather beats one copy per run: when that saves
    copies and the runs are short (mean under ``short_run_bytes``)."""
    return runs > reads + 1 and nbytes < short_run_bytes * runs


@dataclass(frozen=True)
class ReadPlan:
    """One read's share of one KV cache group, the same for every layer of the group."""

    chunk: torch.Tensor  # the chunk's host bytes (uint8)
    section: int  # byte offset of the group's section in the chunk
    stored: int  # blocks of the section in the stored chunk
    skip: int  # section blocks already in vLLM (not copied)
    runs: list[tuple[int, int, int]]  # block_runs of the destination ids
    blocks: int  # destination blocks
    layers: torch.Tensor | None  # [layer, page, ...] typed view of the copied pages, when the
    # group's layers are alike (then a layer's source is one index: the per-layer issue cost)


@dataclass(frozen=True)
class GroupPlan:
    reads: list[ReadPlan]
    staged: bool  # one copy per read into a device staging buffer, then one gather
    blocks: np.ndarray  # every destination block id, in read order (the gather's index)


class Copier:
    """The interface the engine uses (see the module docstring); this one is the host path."""

    kv_addressable = True  # KV pages are host memory: the C++ copy rows may address them

    def register_host(self, address: int, nbytes: int) -> None:  # noqa: B027 - optional
        """Host memory copies will read from (pinned for DMA where the device needs it)."""

    @property
    def pinned_bytes(self) -> int:
        """Host memory registered with the device now."""
        return 0

    def fence(self) -> Any:
        """On the forward's thread as a load is issued: the KV work its copies must follow."""
        return None

    def follow(self, fence: Any) -> None:  # noqa: B027 - optional
        """On the copying thread before a load's copies: order them after ``fence``."""

    def prepare(self, layout: ChunkKV, reads: LoadReads) -> Any:
        """What ``load_layer`` needs of ``reads``, worked out once for every layer."""
        return reads

    def load_layer(self, layout: ChunkKV, li: int, plan: Any) -> Any:
        """Copy layer ``li`` of a prepared load into the KV; returns the mark ``wait`` takes."""
        for read, chunk in plan:
            layout.scatter_read(li, read, chunk)
        return None

    def wait(self, mark: Any) -> None:  # noqa: B027 - optional
        """On the forward's thread: later work on the KV sees the layer of ``mark``."""

    def synchronize(self) -> None:  # noqa: B027 - optional
        """Every copy issued so far is done (its host buffers may be reused)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Unregister the host memory."""


class DeviceCopier(Copier):
    """Per-layer batched host-to-device copies on a side stream (see the module docstring).

    ``prepare`` finds each read's runs once per load (they are the same in every layer of a
    group); ``load_layer`` then only slices and copies. Subclasses implement the device calls:
    ``_register``/``_unregister``, ``_side`` (the side stream as a context, under which the
    staging buffer and the gather belong to it), ``_record``/``_wait_mark``/``_sync``, ``_copy``
    (host -> device) and ``fence``; ``_gather`` is torch's ``index_copy_`` on the KV's device."""

    kv_addressable = False
    short_run_bytes = SHORT_RUN_BYTES

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> bytes

    def register_host(self, address: int, nbytes: int) -> None:
        with self._lock:
            if address in self._registered or not nbytes:
                return
            for start in range(address, address + nbytes, REGISTER_PIECE_BYTES):
                size = min(REGISTER_PIECE_BYTES, address + nbytes - start)
                if self._register(start, size):
                    self._registered[start] = size

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._registered.values())

    def follow(self, fence: Any) -> None:
        if fence is not None:
            with self._side():
                self._wait_mark(fence)

    def prepare(self, layout: ChunkKV, reads: LoadReads) -> dict[int, GroupPlan]:
        per_group: dict[int, list[ReadPlan]] = {}
        alike = {}
        for read, chunk in reads:
            for gi, section, skip, ids in layout.read_groups(read):
                kv = layout.groups[gi]
                if gi not in alike:
                    alike[gi] = _alike(kv)
                n = len(ids)
                layers = None
                if alike[gi]:  # every layer: stored pages one after the other (GroupKV.offset)
                    t, r = kv.layers[0].tensor, kv.layers[0].ratio
                    nbytes = len(kv.layers) * section.num_blocks * kv.layers[0].page_bytes
                    layers = (chunk[section.offset : section.offset + nbytes].view(t.dtype)
                              .view(len(kv.layers), section.num_blocks * r, *t.shape[1:])
                              [:, skip * r : (skip + n) * r])  # fmt: skip
                plan = ReadPlan(chunk, section.offset, section.num_blocks, skip, block_runs(ids),
                                n, layers)  # fmt: skip
                per_group.setdefault(gi, []).append(plan)
        plans = {}
        for gi, rps in per_group.items():
            runs = sum(len(rp.runs) for rp in rps)
            blocks = sum(rp.blocks for rp in rps)
            page = max(layer.page_bytes for layer in layout.groups[gi].layers)
            staged = stage_pays(runs, len(rps), blocks * page, self.short_run_bytes)
            ids = np.concatenate([np.arange(b, b + n) for rp in rps for _, b, n in rp.runs])
            plans[gi] = GroupPlan(rps, staged, ids)
        return plans

    def load_layer(self, layout: ChunkKV, li: int, plan: dict[int, GroupPlan]) -> Any:
        gi, local = layout.where(li)
        with self._side():
            if (group := plan.get(gi)) is not None:
                self._load(layout.groups[gi], local, group)
            return self._record()

    def _load(self, kv: GroupKV, local: int, group: GroupPlan) -> None:
        layer = kv.layers[local]
        t, r, page = layer.tensor, layer.ratio, layer.page_bytes
        shape = t.shape[1:]
        stage = None
        if group.staged:
            stage = torch.empty((len(group.blocks) * r, *shape), dtype=t.dtype, device=t.device)
        at = 0
        for rp in group.reads:
            n = rp.blocks
            if rp.layers is not None:
                host = rp.layers[local]
            else:
                lo = rp.section + kv.offset(local, rp.stored) + rp.skip * page
                host = rp.chunk[lo : lo + n * page].view(t.dtype).view(n * r, *shape)
            if stage is not None:
                self._copy(stage[at : at + n * r], host)
                at += n * r
            elif len(rp.runs) == 1:
                b = rp.runs[0][1]
                self._copy(t[b * r : (b + n) * r], host)
            else:
                for first, b, k in rp.runs:
                    self._copy(t[b * r : (b + k) * r], host[first * r : (first + k) * r])
        if stage is not None:
            pages = torch.from_numpy(group.blocks)
            if r > 1:
                pages = (pages[:, None] * r + torch.arange(r)).reshape(-1)
            self._gather(t, pages, stage)

    def wait(self, mark: Any) -> None:
        if mark is not None:
            self._wait_mark(mark)

    def synchronize(self) -> None:
        self._sync()

    def close(self) -> None:
        self._sync()
        with self._lock:
            for address, nbytes in self._registered.items():
                self._unregister(address, nbytes)
            self._registered.clear()

    # -- device calls ------------------------------------------------------------------------
    def _register(self, address: int, nbytes: int) -> bool:
        raise NotImplementedError

    def _unregister(self, address: int, nbytes: int) -> None:
        raise NotImplementedError

    def _side(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def _record(self) -> Any:
        raise NotImplementedError

    def _wait_mark(self, mark: Any) -> None:
        raise NotImplementedError

    def _sync(self) -> None:
        raise NotImplementedError

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        raise NotImplementedError

    def _gather(self, kv: torch.Tensor, pages: torch.Tensor, stage: torch.Tensor) -> None:
        """The gather kernel: staged pages into the KV's kernel pages ``pages`` (host ids)."""
        kv.index_copy_(0, pages.to(kv.device, non_blocking=True), stage)


def _alike(kv: GroupKV) -> bool:
    """Whether every layer of ``kv`` has pages of one dtype, shape and kernel split."""
    first = kv.layers[0]
    return all(layer.tensor.dtype == first.tensor.dtype and layer.ratio == first.ratio
               and layer.tensor.shape[1:] == first.tensor.shape[1:] for layer in kv.layers)  # fmt: skip


class CudaCopier(DeviceCopier):
    """CUDA through torch: ``cudaHostRegister`` (torch's cudart), a dedicated stream, events."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def fence(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _register(self, address: int, nbytes: int) -> bool:
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        except (AttributeError, RuntimeError) as exc:  # a torch build without the binding
            err, why = -1, str(exc)
        else:
            why = f"error {err}"
        if err != 0:  # e.g. RLIMIT_MEMLOCK: the copies still work, from pageable memory
            logger.warning("kvpool: cudaHostRegister of %d bytes failed (%s); copies from this "
                           "host memory stay pageable", nbytes, why)  # fmt: skip
            return False
        return True

    def _unregister(self, address: int, nbytes: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _wait_mark(self, mark: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(mark)

    def _sync(self) -> None:
        self.stream.synchronize()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def _gather(self, kv: torch.Tensor, pages: torch.Tensor, stage: torch.Tensor) -> None:
        # From pinned memory: a pageable H2D would wait for the side stream's earlier copies.
        kv.index_copy_(0, pages.pin_memory().to(kv.device, non_blocking=True), stage)


COPIERS: dict[str, Callable[[torch.device], Copier]] = {"cuda": CudaCopier}


def copier_for(device: torch.device) -> Copier:
    """The copier of a KV device: ``COPIERS`` by device type, else ``Copier`` (host memory)."""
    make = COPIERS.get(device.type)
    return make(device) if make is not None else Copier()
