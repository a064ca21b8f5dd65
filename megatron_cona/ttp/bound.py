"""The true upper bound of the TTP evaluation: the fastest (global batch x layout) sequence.

Dynamic programming (Dijkstra over simulated time) in the stitched model of
:mod:`megatron_cona.ttp.stitch`, on the same clock and switch costs as every chain: a state is
(running strategy, position on its batch's curve); at every interval boundary any strategy may
follow (switch cost charged by the clock; the first choice is free), training one interval
moves along the real curve. A state is dominated by an earlier-reached state of the same
strategy at least as far along the curve (lower or equal loss, same future), so the search
keeps one frontier per strategy and is exact. ``snap > 0`` rounds the loss at which a chain
enters a new batch's curve DOWN to a multiple of ``snap`` (fewer states; optimistic, so the
result stays a bound). Every chain that moves in this model (static strategies, the planner,
CONA, Pollux) is one path of this search, so none may be faster: a negative gap is a bug.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_cona.lawsim.bound import fastest_micro_batches
from megatron_cona.ttp.stitch import CurveSet, crossing
from predictors.spec import ParallelStrategy


@dataclass
class BoundResult:
    time: float  # simulated seconds to the target (inf: unreachable)
    path: list[tuple[float, float, ParallelStrategy]] = field(default_factory=list)
    # (simulated time, loss) at the start of each interval with the strategy run in it
    states: int = 0  # states expanded (search size)

    @property
    def switches(self) -> int:
        return sum(a[2] != b[2] for a, b in zip(self.path, self.path[1:], strict=False))


def dp_bound(curves: CurveSet, strategies: Sequence[ParallelStrategy],
             step_time: Callable[[ParallelStrategy], float],
             switch_time: Callable[[ParallelStrategy, ParallelStrategy], float],
             target: float, snap: float = 0.0, max_time: float = math.inf) -> BoundResult:
    """Fastest simulated time to ``target`` over every strategy sequence (see module doc)."""
    strats = [s for s in fastest_micro_batches(strategies, step_time) if s.global_batch_size in curves.tracks]
    if not strats:
        raise ValueError("strategies: none has a curve for its global batch")
    interval = curves.interval
    seconds = [interval / s.global_batch_size * step_time(s) for s in strats]
    switch = [[switch_time(a, b) for b in strats] for a in strats]
    frontier = [-math.inf] * len(strats)  # furthest position popped per strategy
    counter = itertools.count()
    # heap entries: (time, tiebreak, strategy index, position, loss, parent)
    heap: list = []
    loss0 = curves.initial_loss
    if loss0 <= target:
        return BoundResult(0.0)
    best_end: tuple[float, object] = (math.inf, None)

    def expand(t: float, i: int | None, x: float, loss: float, node) -> None:
        nonlocal best_end
        for j, s in enumerate(strats):
            b = s.global_batch_size
            if i is not None and strats[i].global_batch_size == b:
                xj, lj = x, loss
            else:
                lj = math.floor(loss / snap) * snap if snap > 0 else loss
                xj = curves.enter(b, lj)
                if xj is None:
                    continue
                lj = curves.tracks[b].loss_at(xj)
            nxt = curves.advance(b, xj)
            if nxt is None:
                continue
            t0 = t + (switch[i][j] if i is not None else 0.0)
            t1 = t0 + seconds[j]
            hit = crossing(t0, t1, lj, nxt, target)
            entry = (t, lj, s)
            if hit is not None:
                if hit < best_end[0]:
                    best_end = (hit, (entry, node))
                continue
            if t1 >= min(best_end[0], max_time) or xj + interval <= frontier[j]:
                continue
            heapq.heappush(heap, (t1, next(counter), j, xj + interval, nxt, (entry, node)))

    expand(0.0, None, 0.0, loss0, None)
    states = 0
    while heap:
        t, _, j, x, loss, node = heapq.heappop(heap)
        if t >= best_end[0]:
            break
        if x <= frontier[j]:
            continue
        frontier[j] = x
        states += 1
        expand(t, j, x, loss, node)
    if best_end[1] is None:
        return BoundResult(math.inf, states=states)
    path, node = [], best_end[1]
    while node is not None:
        path.append(node[0])
        node = node[1]
    return BoundResult(best_end[0], path[::-1], states)
