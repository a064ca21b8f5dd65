"""Placement weights: each device's read bandwidth, fixed in the config or probed.

Each medium probes its own devices (``Medium.probe``): host pools with a memcpy of
``probe.size``, SSDs with the engine's read/write probe in the scratch region after the data, so
no live chunk is touched. The copy threads of a fetch's host share come from a fetch-like copy
probe: the fewest threads that reach its best bandwidth.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

import numpy as np

from vllm_kvpool.config import PoolConfig, PoolConfigError
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.media import medium_of
from vllm_kvpool.native import kvio

MAX_COPY_THREADS = 8  # memory bandwidth is saturated well before this on current servers
THREADS_WITHIN = 0.9  # fewest threads reaching this fraction of the best probed copy
COPY_ROUNDS = 5  # turns each thread count gets in the copy probe
PROBE_PAGE = 64 * 2**10  # a KV page: 16 tokens x 8 KV heads x 128 x bf16 x (K, V)


def copy_thread_counts(cpus: int) -> list[int]:
    """Thread counts the probe tries: powers of two up to the usable CPUs (capped), and that cap."""
    limit = max(1, min(MAX_COPY_THREADS, cpus))
    return sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})


def copy_gbps(threads: Sequence[int], nbytes: int, seconds: float, rounds: int = COPY_ROUNDS,
              page: int = PROBE_PAGE) -> dict[int, float]:  # fmt: skip
    """GB/s of a fetch-like host copy per thread count: ``nbytes`` in ``page``-sized ops into
    pages in shuffled order (a fetch scatters chunk pages over the KV). One large contiguous
    memcpy does not predict it: here one thread copies 10.8 GB/s contiguous but 6.7 GB/s
    scattered, and two threads 8.1 and 9.6 GB/s. The counts take turns over ``rounds`` rounds
    (order reversed every other round) and each gets the median of its rounds: a count timed
    once, in one stretch, got whatever the machine's neighbours did then, and on a shared VM
    the choice between 1 and 2 threads flipped between runs."""
    n = max(1, nbytes // page)
    src = np.ones(n * page, dtype=np.uint8)
    dst = np.zeros(n * page, dtype=np.uint8)
    ops = np.empty((n, 3), dtype=np.uint64)
    order = np.random.default_rng(0).permutation(n).astype(np.uint64)
    ops[:, 0] = np.uint64(dst.ctypes.data) + order * np.uint64(page)
    ops[:, 1] = np.uint64(src.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(page)
    ops[:, 2] = page
    io = kvio()
    io.copy_many(ops, threads=max(threads))  # first touch
    each = seconds / (rounds * len(threads))
    runs: dict[int, list[float]] = {t: [] for t in threads}
    for r in range(rounds):
        for t in threads if r % 2 == 0 else threads[::-1]:
            moved, start = 0, time.perf_counter()
            while moved < n * page or time.perf_counter() - start < each:
                moved += io.copy_many(ops, threads=t)
            runs[t].append(moved / (time.perf_counter() - start) / 1e9)
    return {t: statistics.median(g) for t, g in runs.items()}


def probe_copy_threads(config: PoolConfig) -> int:
    """``copy_threads``, else the fewest threads whose fetch-like copy (``copy_gbps``) is within
    ``THREADS_WITHIN`` of the best (more threads than that only take cores from the SSD
    completions and vLLM); without the probe, one per usable CPU."""
    if config.copy_threads:
        return config.copy_threads
    counts = copy_thread_counts(len(os.sched_getaffinity(0)))
    if not config.probe.enabled or len(counts) == 1:
        return counts[-1]
    gbps = copy_gbps(counts, config.probe.size, config.probe.seconds)
    best = max(gbps.values())
    return min(t for t in counts if gbps[t] >= THREADS_WITHIN * best)


def probe_bandwidths(config: PoolConfig, layout: ChunkLayout) -> list[float]:
    """Read bandwidth (GB/s) per device: fixed ``bandwidth_gbps`` or its medium's short probe."""
    gbps: list[float] = []
    for i, cfg in enumerate(config.devices):
        if cfg.bandwidth_gbps is not None:
            gbps.append(cfg.bandwidth_gbps)
        elif not config.probe.enabled:
            gbps.append(1.0)  # no probe and no figure: equal weights
        else:
            try:
                gbps.append(medium_of(cfg).probe(cfg, config, layout))
            except PoolConfigError:
                raise
            except ValueError as exc:  # the engine refused the entry (a path that is no file
                # or block device, a backend not compiled in): a config error naming the entry
                raise PoolConfigError(f"devices[{i}].{cfg.kind}", str(exc)) from None
    return gbps
