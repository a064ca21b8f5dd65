"""Worker side: schedules chunk transfers between vLLM's paged KV and the pool's media.

The engine owns the threads and decides what moves when; the media handlers
(``vllm_kvpool.handlers``) move the bytes and the chunk layout (``layout.ChunkKV``) says where
they are in the KV. Cut by concern: ``saves`` (gather on a background thread, write
asynchronously), ``loads`` (waves in flight per SSD, resident chunks copied beside them,
layer-by-layer release of sync loads), ``health`` (failed media retried every
``retry_seconds``), ``accounting`` (the one place that records an outcome and builds the
report), ``threads``. ``TransferEngine`` composes them behind the calls the connector's worker
makes.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvpool.device_copy import Copier, copier_for
from vllm_kvpool.engine.accounting import Accounts
from vllm_kvpool.engine.health import DeviceHealth
from vllm_kvpool.engine.loads import LoadPath
from vllm_kvpool.engine.moves import MovePath
from vllm_kvpool.engine.saves import SavePath
from vllm_kvpool.engine.threads import TaskThread
from vllm_kvpool.handlers import MediumHandler
from vllm_kvpool.layout.kv import COPY_THREADS, ChunkKV
from vllm_kvpool.protocol import ChunkMove, ChunkSave, LoadRequest, WorkerReport


class TransferEngine:
    """All worker-side data movement of one rank; thread-safe entry points for the connector.

    ``tiers[d]`` is the handler of pool device ``d`` (the config's device order).
    """

    def __init__(self, tiers: list[MediumHandler], layout: ChunkKV, rank: int = 0,
                 verify_checksums: bool = False, retry_seconds: float = 10.0,
                 copy_threads: int = COPY_THREADS, copier: Copier | None = None) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.copier = copier if copier is not None else copier_for(layout.device)
        for handler in tiers:  # the host memory loads copy from (pinned for a GPU's DMA)
            for address, nbytes in handler.host_regions():
                self.copier.register_host(address, nbytes)
            handler.watch_host_regions(self.copier.register_host)  # a restarted service's
        self._threads = [TaskThread(f"kvpool-{n}") for n in ("save", "load", "reap", "copy")]
        saver, loader, reaper, copy_thread = self._threads
        self.accounts = Accounts(rank, [h.name for h in tiers])
        self.health = DeviceHealth(tiers, self.accounts, reaper, retry_seconds)
        self.saves = SavePath(tiers, layout, self.accounts, self.health, saver, reaper)
        self.loads = LoadPath(tiers, layout, self.copier, self.accounts, self.health, loader,
                              copy_thread, rank, verify_checksums, max(1, copy_threads))  # fmt: skip
        self.moves = MovePath(tiers, layout, self.accounts, rank)

    # -- saves -----------------------------------------------------------------------------
    def save_layer(self, saves: Sequence[ChunkSave], layer_name: str) -> None:
        self.saves.save_layer(saves, layer_name)

    def finish_step_saves(self, saves: Sequence[ChunkSave]) -> None:
        self.saves.finish_step(saves)

    def flush_saves(self) -> None:
        """Wait until every enqueued gather has copied its blocks (before blocks are reused)."""
        self.saves.thread.drain()

    def wait_all(self) -> None:
        """Until every gather, load and write enqueued so far is done."""
        saver, loader, reaper, _ = self._threads
        for thread in (saver, loader, reaper):
            thread.drain()

    # -- loads -----------------------------------------------------------------------------
    def start_loads(self, loads: Sequence[LoadRequest]) -> None:
        """Issue this step's loads; sync ones release layers through ``wait_layer``."""
        self.loads.start(loads)

    def wait_layer(self, layer_name: str) -> None:
        self.loads.wait_layer(layer_name)

    def wait_sync_loads(self) -> None:
        self.loads.wait_sync()

    # -- migration -------------------------------------------------------------------------
    def start_moves(self, moves: Sequence[ChunkMove], bytes_per_second: float) -> None:
        """Copy stored chunks to their new slots in the background (``migration``)."""
        self.moves.start(moves, bytes_per_second)

    def wait_moves(self) -> None:
        self.moves.drain()

    # -- reporting -------------------------------------------------------------------------
    def take_finished(self, deferred_free: Sequence[str]) -> tuple[set[str], set[str], set[str]]:
        """See ``Accounts.take_finished``."""
        return self.accounts.take_finished(deferred_free)

    def take_invalid_blocks(self) -> set[int]:
        return self.accounts.take_invalid_blocks()

    def take_report(self) -> WorkerReport:
        self.health.retry_due()
        return self.accounts.take_report()

    def close(self) -> None:
        try:
            self.wait_all()
            self.moves.drain()
        finally:
            self.moves.close()
            for thread in self._threads:
                thread.shutdown()
            self.copier.close()  # unregisters the host memory before the handlers free it
            for handler in self.tiers:
                handler.close()
