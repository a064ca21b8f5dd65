"""Placement weights: each device's read bandwidth, fixed in the config or probed.

Host pools are probed with a memcpy of ``probe.size``; SSDs with the engine's read/write probe
in the scratch region after the data, so no live chunk is touched. The copy threads of a fetch's
host share come from the same memcpy probe: the fewest threads that reach the memory bandwidth.
"""

from __future__ import annotations

import os

from vllm_kvpool.config import PoolConfig
from vllm_kvpool.handlers import handler_class
from vllm_kvpool.handlers.device import DeviceHandler
from vllm_kvpool.native import kvio
from vllm_kvpool.pool import PoolGeometry

PROBE_CHUNK = 2 * 2**20
MAX_COPY_THREADS = 8  # memory bandwidth is saturated well before this on current servers
THREADS_WITHIN = 0.9  # fewest threads reaching this fraction of the best probed memcpy


def copy_thread_counts(cpus: int) -> list[int]:
    """Thread counts the probe tries: powers of two up to the usable CPUs (capped), and that cap."""
    limit = max(1, min(MAX_COPY_THREADS, cpus))
    return sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})


def probe_copy_threads(config: PoolConfig) -> int:
    """``copy_threads``, else the fewest memcpy threads within ``THREADS_WITHIN`` of the best
    probed bandwidth (more threads than that only take cores from the SSD completions and
    vLLM); without the probe, one per usable CPU."""
    if config.copy_threads:
        return config.copy_threads
    counts = copy_thread_counts(len(os.sched_getaffinity(0)))
    if not config.probe.enabled or len(counts) == 1:
        return counts[-1]
    io = kvio()
    gbps = {t: float(io.probe_memcpy(seconds=config.probe.seconds / len(counts),
                                     nbytes=config.probe.size, threads=t)["gbps"])
            for t in counts}  # fmt: skip
    best = max(gbps.values())
    return min(t for t in counts if gbps[t] >= THREADS_WITHIN * best)


def probe_bandwidths(config: PoolConfig, geometry: PoolGeometry) -> list[float]:
    """Read bandwidth (GB/s) per device: fixed ``bandwidth_gbps`` or a short probe."""
    gbps: list[float] = []
    for cfg in config.devices:
        if cfg.bandwidth_gbps is not None:
            gbps.append(cfg.bandwidth_gbps)
            continue
        if not config.probe.enabled:
            gbps.append(1.0)  # no probe and no figure: equal weights
            continue
        io = kvio()
        if cfg.kind == "host":
            result = io.probe_memcpy(seconds=config.probe.seconds, nbytes=config.probe.size)
            gbps.append(float(result["gbps"]))
            continue
        cls = handler_class(cfg)
        assert issubclass(cls, DeviceHandler)
        dev, _, _ = cls.open_raw(cfg, geometry)
        try:
            pool = None
            if cfg.backend == "spdk":  # registered (hugetlb) buffers: over PCIe nothing else DMAs
                pool = io.HostPool(PROBE_CHUNK * max(2, dev.queue_depth), numa_node=cfg.numa_node,
                                   name=f"{cfg.name}-probe")  # fmt: skip
                dev.register_host_pools([pool])
            result = io.probe_device(dev, seconds=config.probe.seconds, chunk_bytes=PROBE_CHUNK,
                                     pool=pool)  # fmt: skip
        finally:
            dev.close()
        gbps.append(max(float(result["read_gbps"]), 1e-3))
    return gbps
