"""Background migration of stored chunks (issue #46 item 2): which chunks move where.

Placement stripes NEW chunks by each device's current bandwidth estimate (``bandwidth``), but
chunks already stored stay where an older estimate put them: after a device slows down (a shared
SSD, thermal throttling), the prefixes it holds keep being fetched at its new speed. A device's
*share time* is the time it needs to read everything it holds (stored bytes / its estimated read
bandwidth); a fetch of a prefix striped like the pool takes as long as the longest share. When
one device's share time exceeds another's by more than ``margin`` (relative), chunks move from
the first to the second, one at a time, while the move still leaves the source above the
destination by the margin (so moves never oscillate between two devices of similar speed).

The weights are each device's share of the split the guard keeps (``split_guard``: the split
new chunks are placed by, kept only once a fetch measured it no slower), not the read
estimates themselves (issue #46, third session): on a device whose rate depends on its share
(a token bucket) an estimate measured below its knee proposes a share past it, which the guard
measures and refuses; moves by the estimate would put stored chunks there anyway. Only the
ratios of the weights matter, so share times are relative, not seconds.

Pure logic: the pool (``UnifiedPool.plan_moves``) reserves the destination slots and pins the
chunks; the engine (``engine/moves.py``) copies them in the background at a bounded rate; the
pool swaps each chunk's location once every rank copied it, and frees the old slot once no load
reads it. Crash consistency is the SSDs' write order (``persist``): the new copy's data and
record are durable before the old slot can be reused, whose record is erased before any new data
lands there, so after a crash at any point one intact copy of every chunk is on its devices.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MARGIN = 0.25  # a share time this much longer than another's starts moves


def share_times(stored: Sequence[int], gbps: Sequence[float]) -> list[float]:
    """Seconds each device needs to read what it holds at ``gbps`` (inf for a device of no
    bandwidth); with relative weights, times in the same relative unit."""
    return [b / (g * 1e9) if g > 0 else (float("inf") if b else 0.0)
            for b, g in zip(stored, gbps, strict=True)]  # fmt: skip


def pick_moves(stored: Sequence[int], gbps: Sequence[float], free: Sequence[int],
               chunk_bytes: Sequence[Sequence[int]], margin: float = DEFAULT_MARGIN,
               limit: int = 1 << 30) -> list[tuple[int, int, int]]:  # fmt: skip
    """Moves ``(source device, index in chunk_bytes[source], destination)``, at most ``limit``.

    ``stored[d]``: bytes device ``d`` holds; ``gbps[d]``: its read weight (only the ratios
    matter; the pool passes the guard's kept shares; 0: failed, takes nothing); ``free[d]``:
    its free slots; ``chunk_bytes[d]``: the sizes of its movable chunks
    in the order they should move (most useful first). Each move takes a chunk from the device
    with the longest share time to the one whose share time stays shortest after taking it,
    while the source would still exceed the destination's new share time by ``margin``."""
    stored, free = list(stored), list(free)
    taken = [0] * len(stored)
    moves: list[tuple[int, int, int]] = []
    while len(moves) < limit:
        times = share_times(stored, gbps)
        order = sorted(range(len(stored)), key=lambda d: -times[d])
        src = next((d for d in order if taken[d] < len(chunk_bytes[d])), None)
        if src is None:
            return moves
        size = chunk_bytes[src][taken[src]]
        after = {d: (stored[d] + size) / (gbps[d] * 1e9) for d in range(len(stored))
                 if d != src and gbps[d] > 0 and free[d] > 0}  # fmt: skip
        if not after:
            return moves
        dst = min(after, key=lambda d: (after[d], d))
        if times[src] <= (1 + margin) * after[dst]:
            return moves  # balanced within the margin
        moves.append((src, taken[src], dst))
        taken[src] += 1
        stored[src] -= size
        stored[dst] += size
        free[dst] -= 1
    return moves
