"""Background migration on the worker (``migration``): copy a stored chunk to its new slot.

One thread, one chunk at a time, through the media handlers: the source is verified against its
checksum (read into a private buffer, or in place for host memory), then written to the
destination with its index record, exactly as a save writes it (the SSD write order keeps it
crash-consistent). It uses its own buffer, never the staging buffers a fetch waits for, and
paces itself to ``bytes_per_second``, so it never holds up a load; a failed copy is reported
and the chunk stays where it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from vllm_kvpool.engine.accounting import Accounts
from vllm_kvpool.engine.threads import TaskThread
from vllm_kvpool.handlers import LoadOp, MediumHandler, SaveOp
from vllm_kvpool.layout.kv import ChunkKV
from vllm_kvpool.native import kvio
from vllm_kvpool.protocol import ChunkMove

logger = logging.getLogger("vllm_kvpool")


class MovePath:
    def __init__(self, tiers: Sequence[MediumHandler], layout: ChunkKV, accounts: Accounts,
                 rank: int) -> None:  # fmt: skip
        self.tiers = tiers
        self.layout = layout
        self.accounts = accounts
        self.rank = rank
        self.thread = TaskThread("kvpool-move")
        self.io = kvio()
        self._buffer = None  # one slot of private aligned memory, made on the first move

    def start(self, moves: Sequence[ChunkMove], bytes_per_second: float) -> None:
        """Copy ``moves`` in the background, at most ``bytes_per_second`` on average."""
        if moves:
            self.thread.submit(self._run, list(moves), bytes_per_second)

    def drain(self) -> None:
        self.thread.drain()

    def _run(self, moves: list[ChunkMove], bytes_per_second: float) -> None:
        start, moved = time.perf_counter(), 0
        for move in moves:
            ok = False
            try:
                ok = self._copy(move)
            except Exception:  # a bug or an unexpected error: the chunk simply stays
                logger.exception("kvpool: moving a chunk to %s failed", self.tiers[move.dest_device].name)
            self.accounts.move_done(move.key, ok)
            moved += self.layout.nbytes(move.num_blocks)
            ahead = moved / bytes_per_second - (time.perf_counter() - start)
            if ahead > 0:  # bounded bandwidth: the pool's own traffic comes first
                time.sleep(ahead)

    def _copy(self, move: ChunkMove) -> bool:
        src, dst = self.tiers[move.device], self.tiers[move.dest_device]
        if src.failed or dst.failed:
            return False
        nbytes = self.layout.nbytes(move.num_blocks)
        expected = move.checksums.get(self.rank)
        if src.resident:  # verified in place
            address = src.load_buffer(move.slot, nbytes).address
            target: int = address
        else:
            if self._buffer is None:
                self._buffer = self.io.HostPool(src.slot_bytes if src.slot_bytes >= dst.slot_bytes
                                                else dst.slot_bytes, hugepages=False,
                                                name="kvpool-move")  # fmt: skip
            target = address = self._buffer.address
        (read,) = src.wait(src.submit_load([LoadOp(move.slot, target, nbytes, expected)]))
        if not read.ok:
            return False
        if dst.resident:
            into = dst.save_buffer(move.dest_slot, nbytes)
            self.io.memcpy(into.address, address, nbytes)
            address = into.address
        (written,) = dst.wait(dst.submit_save([SaveOp(move.dest_slot, address, nbytes,
                                                      move.block_hashes)]))  # fmt: skip
        return written.ok and (expected is None or written.checksum == expected)

    def close(self) -> None:
        self.thread.shutdown()
        self._buffer = None
