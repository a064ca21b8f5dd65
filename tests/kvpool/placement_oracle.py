"""The fetch-time oracle the placement tests check bandwidth placement against.

``fetch_seconds`` is the time a placement takes to fetch when every device streams its share in
parallel; ``optimal_fetch`` is the best any placement can do under capacity limits.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def fetch_seconds(bytes_per_device: Sequence[int], gbps: Sequence[float]) -> float:
    """Time to fetch when every device streams its share in parallel: max_d bytes_d / bw_d."""
    times = [b / (g * 1e9) for b, g in zip(bytes_per_device, gbps, strict=True) if b > 0 and g > 0]
    return max(times, default=0.0)


def optimal_fetch(
    num_chunks: int, chunk_bytes: int, gbps: Sequence[float], caps: Sequence[int]
) -> tuple[float, list[int]]:
    """The capacity-constrained optimum: the shortest time in which ANY placement of
    ``num_chunks`` equal chunks can be fetched when device ``d`` streams ``gbps[d]`` GB/s and
    holds at most ``caps[d]`` chunks, with the chunks per device that reach it.

    Minimises ``max_d n_d * chunk_bytes / bw_d`` over integer ``n`` with ``sum n = num_chunks``
    and ``0 <= n_d <= caps[d]``: each chunk in turn goes to the device that would finish it
    earliest. For identical chunks this greedy is optimal (moving a chunk off the device that
    finishes last to one that would finish it sooner never hurts; tests check it against brute
    force). Unlike ``bytes / sum(gbps)``, this bound is reachable when capacities bind.
    """
    if len(gbps) != len(caps):
        raise ValueError(f"optimal_fetch: {len(gbps)} bandwidths but {len(caps)} capacities")
    usable = [d for d in range(len(gbps)) if gbps[d] > 0 and caps[d] > 0]
    if num_chunks > sum(caps[d] for d in usable):
        raise ValueError(f"optimal_fetch: num_chunks={num_chunks} exceeds the capacity of the "
                         f"devices with bandwidth ({sum(caps[d] for d in usable)} chunks)")  # fmt: skip
    counts = [0] * len(gbps)
    heap = [(1 / gbps[d], d) for d in usable]
    heapq.heapify(heap)
    for _ in range(num_chunks):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        if counts[d] < caps[d]:
            heapq.heappush(heap, ((counts[d] + 1) / gbps[d], d))
    return fetch_seconds([n * chunk_bytes for n in counts], gbps), counts
