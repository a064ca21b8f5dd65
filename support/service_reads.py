"""Issue #43's "SSD I/O in the engine or in the service", option (b), for the node benchmark only.

Today (a) an engine's worker reads its SSD chunks itself (``_kvio.Device``: io_uring + O_DIRECT,
straight into KV pages where they are aligned, else into its registered staging buffers) while
the service owns only the index. Option (b): the service reads the chunk into host memory it
shares with the engine (a memfd, as its host pools are), and the engine copies it into the KV in
place from there, as it does a host-pool chunk.

``ServiceReads`` measures (b) without putting it in the product: a child process in the
service's place (``python -m support.service_reads``) opens the same SSD file with the same C++
engine, registers a shared ring of ``ring`` chunk slots (as many as the engine's staging
buffers: the same host memory on both sides) and reads each request's chunks into it in waves
of half the ring, two waves in flight, verifying every chunk's XXH3-64 as the engine's reads do.
It sends each finished wave's ring slots over a socket pair; the engine copies them into the KV
(``ChunkKV.read_ops`` + ``_kvio.copy_many``, the host pool's path) while the next wave is read,
and gives the slots back. The engine plans the fetch (``LocalPool.plan``) and pins its chunks exactly as a
fetch does; the timer runs from sending the request to the last byte in the KV.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class _Lines:
    """Newline-delimited JSON over a socket, readable without blocking."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.conn.sendall(json.dumps(msg).encode() + b"\n")

    def ready(self) -> list[dict[str, Any]] | None:
        """The messages received so far (reads once); None when the peer closed."""
        data = self.conn.recv(1 << 16)
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines]

    def next(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            data = self.conn.recv(1 << 16)
            if not data:
                raise RuntimeError("service_reads: the reader process exited")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class ServiceReads:
    """Option (b) for one SSD device of a ``LocalPool`` (see the module docstring)."""

    def __init__(self, pool: Any, device: int, log: IO[bytes]) -> None:
        from vllm_kvpool.native import kvio

        self.pool = pool
        self.io = kvio()
        handler = pool.handlers[device]
        self.handler = handler
        self.slot_bytes = handler.slot_bytes
        self.ring = handler.staging_slots
        self.shm = self.io.HostPool(self.ring * self.slot_bytes, shared=True,
                                    name="service-reads")  # fmt: skip
        ours, theirs = socket.socketpair()
        spec = {"path": handler.target, "capacity": handler.device.capacity,
                "backend": handler.device.backend, "data_base": handler.data_base,
                "slot_bytes": self.slot_bytes, "ring": self.ring, "fd": self.shm.fd,
                "pool_bytes": self.shm.capacity, "sock": theirs.fileno()}  # fmt: skip
        self.proc = subprocess.Popen([sys.executable, "-m", "support.service_reads", json.dumps(spec)],
                                     cwd=REPO, pass_fds=(self.shm.fd, theirs.fileno()),
                                     stderr=log)  # fmt: skip
        theirs.close()
        self.lines = _Lines(ours)
        if self.lines.next() != {"ready": True}:
            raise RuntimeError("service_reads: the reader process did not start")

    def fetch(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
              threads: int) -> tuple[int, float, bool]:  # fmt: skip
        """(blocks, seconds, every chunk verified) of the pool's hit, read by the child."""
        kv = self.pool.engine.layout
        plan = self.pool.plan(block_hashes, block_ids)
        reads = plan.reads
        ok = True
        self.pool.pool.pin(plan.entries)
        try:
            start = time.perf_counter()
            self.lines.send({"reads": [[r.slot, kv.nbytes(r.stored_blocks), r.checksums.get(0)]
                                       for r in reads]})  # fmt: skip
            done = 0
            while done < len(reads):
                wave = self.lines.next()["wave"]
                ops = [kv.read_ops(reads[i], self.shm.address + ring * self.slot_bytes)
                       for i, ring, good in wave if good]  # fmt: skip
                ok = ok and all(good for _, _, good in wave)
                if ops:
                    self.io.copy_many(np.concatenate(ops), threads=threads)
                self.lines.send({"free": [ring for _, ring, _ in wave]})
                done += len(wave)
            seconds = time.perf_counter() - start
        finally:
            self.pool.pool.unpin(plan.entries)
        return plan.blocks, seconds, ok

    def close(self) -> None:
        self.lines.conn.close()
        self.proc.wait(timeout=30)


def _serve(spec: dict[str, Any]) -> None:
    """The service's side: read requested slots into the shared ring, wave by wave."""
    from vllm_kvpool.native import kvio

    io = kvio()
    dev = io.Device(spec["path"], capacity=spec["capacity"], backend=spec["backend"],
                    create=False, name="service-reads")  # fmt: skip
    shm = io.HostPool.attach(spec["fd"], spec["pool_bytes"], name="service-reads")
    dev.register_host_pools([shm])
    lines = _Lines(socket.socket(fileno=spec["sock"]))
    slot_bytes, align = spec["slot_bytes"], dev.alignment
    free = list(range(spec["ring"]))
    wave_size = max(1, spec["ring"] // 2)
    todo: deque[tuple[int, list]] = deque()
    inflight: deque[tuple[int, list[tuple[int, int]]]] = deque()
    lines.send({"ready": True})
    while True:
        while todo and free and len(inflight) < 2:
            batch, ops = [], []
            while todo and free and len(batch) < wave_size:
                i, (slot, nbytes, expected) = todo.popleft()
                ring = free.pop()
                batch.append((i, ring))
                ops.append((spec["data_base"] + slot * slot_bytes, shm.address + ring * slot_bytes,
                            -(-nbytes // align) * align, expected))  # fmt: skip
            inflight.append((dev.submit_read(ops), batch))
        progressed = False
        while inflight and (not todo or not free or dev.poll(inflight[0][0])):
            # Nothing else to submit: sleep in the kernel until the oldest wave is done.
            ticket, batch = inflight.popleft()
            results = dev.wait(ticket, check=False)
            lines.send({"wave": [[i, ring, r.ok] for (i, ring), r in zip(batch, results, strict=True)]})
            progressed = True
            if todo and free:
                break
        timeout = 0.0 if progressed else (0.0002 if inflight else None)
        if select.select([lines.conn], [], [], timeout)[0]:
            msgs = lines.ready()
            if msgs is None:
                break  # the engine closed: done
            for msg in msgs:
                if "reads" in msg:
                    todo.extend(enumerate(msg["reads"]))
                free.extend(msg.get("free", ()))
    dev.close()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
