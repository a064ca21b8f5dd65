"""Run a function on N gloo CPU ranks and collect each rank's return value.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo
world on a free 127.0.0.1 port, calls ``fn(rank, world_size, *args)`` on every rank and returns the
list of return values (ordered by rank).  Any rank raising fails the whole call with that rank's
traceback; a rank hanging past ``timeout`` fails it with a timeout error and every process is
killed.  ``fn`` must be importable (module level) and its arguments picklable.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class DistributedRunError(RuntimeError):
    """A rank failed (its traceback is in the message) or the world timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results,
            threads: int, cpu_shim: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if cpu_shim:
            from megatron_cpu.cuda_redirect import install

            install()
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
                    threads: int = 1, cpu_shim: bool = True, start_method: str = "spawn"
                    ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see module doc."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, threads,
                                          cpu_shim))  # not daemonic: ranks may fork helpers
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"distributed run timed out after {timeout:.0f}s; ranks done: "
                    f"{sorted(values)}" + "".join(failures))
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not failures:
                    # A rank died without reporting (segfault, os._exit); the rest will hang.
                    time.sleep(1.0)
                    if results.empty():
                        raise DistributedRunError(
                            f"rank(s) {dead} exited with codes "
                            f"{[procs[i].exitcode for i in dead]} without a result") from None
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures.append(f"\n--- rank {rank} ---\n{payload}")
                break  # the others are probably blocked on the failed rank
        if failures:
            raise DistributedRunError("distributed run failed:" + "".join(failures))
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
