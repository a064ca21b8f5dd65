"""Bounds of the law-based simulation: nothing that moves on the law can be faster.

:func:`relaxed_bound` (what the benchmark asserts against): the fastest time to each target
when the strategy may change continuously and switching is free -- a relaxation of every
chain's problem, so a valid lower bound, computed exactly (quadrature on the law's tables):
for ``B_crit(L)`` the best rate ``max_b (b / t_b) / (b + B_crit(S))`` at every ``S`` (the law
is Markov in S); for ``B_crit(D)`` Lagrangian duality over the tokens seen (weak duality keeps
it a lower bound).

:func:`exact_bound`: the exact dynamic program with the chains' decision cadence and switch
costs (tested equal to brute force), vectorised over Pareto fronts and pruned by the
relaxation's cost-to-go (:data:`TO_GO`): a state that cannot beat a cap, even at the
relaxation's pace from there on, is dropped (branch and bound with an admissible heuristic:
still exact below the cap). The caps start just above the relaxation and widen in rounds
(:data:`FIRST_MARGIN`) until every goal's time is under its cap or the cap is a time some path
achieves (the greedy one's): how many states survive grows with the cap's distance above the
relaxation, and the greedy path is far off where a batch switch costs far more than a layout
switch.

The exact DP runs over the decision boundaries every chain uses (token positions
``boundaries``): at each boundary any strategy may follow (switch cost charged; the first choice
is free); one interval advances the law's state exactly (:class:`~megatron_cona.lawsim.law.
CriticalBatch`). Entering a strategy at a boundary, an entry is dropped before it is advanced
when another entry into the same strategy is at least as far along and no later (:func:`_front`:
the law's flow is monotone in ``S`` and the future depends only on (S, D, strategy), D being
fixed by the boundary), so the search is exact; every front is advanced for every next strategy
at once (numpy), fast enough for the paper's scales inside the benchmark. ``snap > 0`` rounds
``S`` UP to a log grid of that relative step (optimistic: still a bound; the benchmark's default
is 0, no rounding). The target is hit inside an interval at the exact token count
(``tokens_to``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_cona.lawsim.constants import value
from megatron_cona.lawsim.law import CriticalBatch, DataCriticalBatch, LossCriticalBatch
from predictors.spec import ParallelStrategy


@dataclass
class BoundPath:
    time: float  # seconds to the target (inf: unreachable within the boundaries)
    path: list[tuple[float, float, ParallelStrategy]] = field(default_factory=list)
    # (time, tokens) at the start of every interval with the strategy run in it

    @property
    def switches(self) -> int:
        return sum(a[2] != b[2] for a, b in zip(self.path, self.path[1:], strict=False))


def fastest_micro_batches(strategies: Sequence[ParallelStrategy],
                          step_time: Callable[[ParallelStrategy], float]
                          ) -> list[ParallelStrategy]:
    """Per (layout, global batch) the fastest micro-batch: a micro-batch change within a layout
    costs a batch switch like any batch change, so a slower micro-batch is never better."""
    best: dict[tuple, ParallelStrategy] = {}
    for s in strategies:
        key = (s.layout, s.global_batch_size)
        if key not in best or (step_time(s), s.name) < (step_time(best[key]), best[key].name):
            best[key] = s
    return sorted(best.values(), key=lambda s: s.name)


def _front(t: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Mask over ``order`` (the states furthest along in ``S`` first) of those no state
    before them in it is as early as: the law's flow is monotone in ``S`` and the future
    depends only on (S, D, strategy), so a dominated state's every continuation is matched by
    its dominator's."""
    running = np.minimum.accumulate(t[order])
    keep = np.ones(order.size, dtype=bool)
    keep[1:] = t[order][1:] < running[:-1]
    return keep


def _pareto(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Indices of the states no other state beats (at least as far along in ``S`` and no
    later; see :func:`_front`)."""
    order = np.lexsort((t, -s))  # furthest along first, earliest first among equals
    return order[_front(t, order)]


ToGo = Callable[[np.ndarray, float, float], np.ndarray]
# (S, tokens seen, goal S) -> seconds no strategy sequence can beat from there to the goal


def _room(to_go: ToGo | None, s: np.ndarray, d: float, goals: Sequence[float],
          achieved: np.ndarray) -> np.ndarray:
    """Per state (``S`` after ``d`` tokens), the time before which it must be there to still
    reach some goal ahead of it sooner than a time already achieved, going at the
    relaxation's pace from there (a lower bound; the slacks cover the tables' rounding):
    -inf with no goal ahead, inf without a relaxation (``to_go`` None)."""
    if to_go is None:
        return np.full(s.size, math.inf)
    room = np.full(s.size, -math.inf)
    for goal, cap in zip(goals, achieved, strict=True):
        ahead = s < goal
        if ahead.any():
            room[ahead] = np.maximum(room[ahead], cap * (1 + 1e-9)
                                     - to_go(s[ahead], d, goal) * (1 - 1e-6))
    return room


def _greedy(dynamics: CriticalBatch, boundaries: Sequence[float], batch: np.ndarray,
            iter_s: np.ndarray, switch: np.ndarray, to_go: ToGo, goal: float, s0: float
            ) -> float:
    """A time some path of the DP achieves to ``goal`` (the last round's cap in
    :func:`exact_bound`): at each boundary the strategy whose finish is soonest at the relaxation's pace
    from the interval's end, and every finish inside an interval on the way."""
    s, t, prev, done = s0, 0.0, -1, math.inf
    for k in range(len(boundaries) - 1):
        d, tokens = boundaries[k], boundaries[k + 1] - boundaries[k]
        t0 = t + (switch[prev] if prev >= 0 else np.zeros(batch.size))
        s2 = np.array([float(dynamics.advance_many(np.array([s]), d, b, tokens)[0])
                       for b in batch])
        for j in np.flatnonzero(s2 >= goal):
            done = min(done, t0[j] + dynamics.tokens_to(s, d, batch[j], goal)
                       / batch[j] * iter_s[j])
        t1 = t0 + tokens / batch * iter_s
        score = np.where(s2 < goal, t1 + to_go(s2, boundaries[k + 1], goal), math.inf)
        prev = int(np.argmin(score))
        if not math.isfinite(score[prev]) or t1[prev] >= done:
            break
        s, t = float(s2[prev]), float(t1[prev])
    return done


@dataclass
class _Layer:
    """The decisions kept at one boundary: strategy, start time and parent (an index into the
    previous layer), with the state each reaches at the next boundary and the time it must
    reach it before to stay useful (:func:`_room`)."""

    strategy: np.ndarray
    start: np.ndarray
    parent: np.ndarray
    end_time: np.ndarray
    end_s: np.ndarray
    end_room: np.ndarray


# The first round's caps lie this relative margin above the relaxation's time from the start
# (the exact DP was 0.005-0.08% above it at the benchmark's switch costs); each later round
# doubles the margin, and once the margin passes LAST_MARGIN or the cap would pass the greedy
# path's time the round runs against that time, which settles every goal left. Why rounds: a
# state is kept while it may beat the cap at the relaxation's pace, so the fronts grow with
# the cap's distance above the relaxation, and the greedy path can be far off: 11% above the
# optimum for BERT-large on 8 GPUs with a batch switch of an hour (`cona scale --switch-costs
# 0,3600`; a layout switch, which may change the batch too, took milliseconds there), where
# the fronts grew past 600,000 states and the DP past 100 s (at 1e30 s it never returned),
# against under a second from a cap 0.01% above the relaxation. A round under the optimum
# finds no path and costs little.
FIRST_MARGIN = 1e-4
LAST_MARGIN = 1.0


def exact_bound(dynamics: CriticalBatch, boundaries: Sequence[float],
                strategies: Sequence[ParallelStrategy], seq_length: int,
                step_time: Callable[[ParallelStrategy], float],
                switch_time: Callable[[ParallelStrategy, ParallelStrategy], float],
                goals: Sequence[float], s0: float, snap: float = 0.0,
                prune: bool = True) -> list[BoundPath]:
    """The fastest time to reach each ``S`` in ``goals`` from ``s0`` (see module doc): a
    dynamic program over the boundaries whose states are kept as one Pareto front of
    (time, S) per strategy, advanced for every next strategy at once (numpy). ``snap > 0``
    rounds ``S`` up to a log grid of that relative step (fewer states, still a bound).
    ``prune``: drop every state that cannot beat a cap even at the relaxation's pace from
    there on (:data:`TO_GO`; exact, only faster). The caps widen in rounds from just above the
    relaxation (:data:`FIRST_MARGIN`): a goal whose best time is under its round's cap is
    settled (no path that beats the cap was dropped, so none beats that time); the others run
    again with twice the margin, the last round against a time some path achieves (the
    greedy one's)."""
    strats = fastest_micro_batches(strategies, step_time)
    if not strats:
        raise ValueError("strategies: empty")
    batch = np.array([x.global_batch_size * seq_length for x in strats], dtype=float)
    iter_s = np.array([step_time(x) for x in strats])
    switch = np.array([[0.0 if a == b else switch_time(a, b) for b in strats] for a in strats])
    dp = _Problem(dynamics, boundaries, strats, batch, iter_s, switch, s0, snap)
    if not prune:
        return _search(dp, goals, [math.inf] * len(goals), None)
    rates = sorted(set(zip(batch.tolist(), iter_s.tolist(), strict=True)))
    to_go = _to_go(dynamics, rates, s0, goals, boundaries)
    greedy = [_greedy(dynamics, boundaries, batch, iter_s, switch, to_go, g, s0) for g in goals]
    relaxed = [float(to_go(np.array([s0]), boundaries[0], g)[0]) for g in goals]
    out: list[BoundPath | None] = [None] * len(goals)
    margin = FIRST_MARGIN
    while pending := [g for g, p in enumerate(out) if p is None]:
        caps = [relaxed[g] * (1 + margin) if margin <= LAST_MARGIN
                and relaxed[g] * (1 + margin) < greedy[g] else greedy[g] for g in pending]
        found = _search(dp, [goals[g] for g in pending], caps, to_go)
        for g, cap, path in zip(pending, caps, found, strict=True):
            if path.time < cap or cap == greedy[g]:
                out[g] = path
        margin *= 2
    return [p for p in out if p is not None]  # every goal settled: the last cap is greedy's


@dataclass
class _Problem:
    """What every round of :func:`exact_bound` searches (its strategies: the fastest
    micro-batch of each)."""

    dynamics: CriticalBatch
    boundaries: Sequence[float]
    strats: list[ParallelStrategy]
    batch: np.ndarray  # tokens per iteration
    iter_s: np.ndarray
    switch: np.ndarray  # switch[a, b]: seconds from strategy a to b
    s0: float
    snap: float


def _search(dp: _Problem, goals: Sequence[float], caps: Sequence[float], to_go: ToGo | None
            ) -> list[BoundPath]:
    """One round of :func:`exact_bound`: the fastest path to each goal, exact wherever it
    beats the goal's cap (a state is dropped once ``to_go``, the relaxation, says it cannot
    beat any cap; ``None``: only the DP's own best times prune)."""
    dynamics, boundaries, batch, iter_s, switch = (dp.dynamics, dp.boundaries, dp.batch,
                                                   dp.iter_s, dp.switch)
    n = len(dp.strats)
    cap = np.array(caps, dtype=float)
    best = np.full(len(goals), math.inf)
    best_node: list[tuple[int, int, float, int] | None] = [None] * len(goals)
    layers: list[_Layer] = []
    # the states entering boundary k: strategy run before, time, S, index in the last layer,
    # room (see _Layer)
    cur_j, cur_t = np.arange(n), np.zeros(n)
    cur_s, cur_id, cur_room = np.full(n, dp.s0), np.full(n, -1), np.full(n, math.inf)
    for k in range(len(boundaries) - 1):
        d, tokens = boundaries[k], boundaries[k + 1] - boundaries[k]
        limit = np.max(np.minimum(best, cap)) * (1 + 1e-12)
        parts: list = []
        order = np.lexsort((cur_t, -cur_s))  # furthest along first, earliest first among equals
        for j2 in range(n):
            # the first choice is free: at k = 0 every strategy starts on its own
            t0 = cur_t + (0.0 if k == 0 else switch[cur_j, j2])
            if k:
                # before advancing: an entry into j2 that another entry into j2 beats (as far
                # along and no later: advancing with j2 keeps that order) or that comes too
                # late to beat a cap leads nowhere. Per next strategy, not per pair of states:
                # where a batch switch costs far more than a layout switch, no state can
                # follow another's every continuation (each lacks the cheap switches of the
                # other's layout), yet each entry has a dominator among all the entries
                use = np.zeros(t0.size, dtype=bool)
                use[order[_front(t0, order)]] = True
                use &= (t0 < limit) & (t0 < cur_room)
            else:
                use = cur_j == j2
            if not use.any():
                continue
            t0, s, parent = t0[use], cur_s[use], cur_id[use]
            s2 = dynamics.advance_many(s, d, batch[j2], tokens)
            for g, goal in enumerate(goals):
                hit = (s < goal) & (goal <= s2)
                if hit.any():
                    when = t0[hit] + dynamics.tokens_to_many(s[hit], d, batch[j2], goal) \
                        / batch[j2] * iter_s[j2]
                    i = int(np.argmin(when))
                    if when[i] < best[g]:
                        best[g] = when[i]
                        best_node[g] = (k, j2, float(t0[hit][i]), int(parent[hit][i]))
            t1 = t0 + tokens / batch[j2] * iter_s[j2]
            if dp.snap > 0:
                s2 = np.exp(np.ceil(np.log(s2) / dp.snap) * dp.snap)
            room = _room(to_go, s2, boundaries[k + 1], goals, np.minimum(best, cap))
            hope = t1 < room
            t0, s2, parent, t1, room = t0[hope], s2[hope], parent[hope], t1[hope], room[hope]
            keep = _pareto(t1, s2)
            parts.append((np.full(keep.size, j2), t0[keep], parent[keep], t1[keep], s2[keep],
                          room[keep]))
        limit = np.max(np.minimum(best, cap)) * (1 + 1e-12)
        if not parts:
            break
        layer = _Layer(*(np.concatenate(x) for x in zip(*parts, strict=True)))
        alive = np.flatnonzero(layer.end_time < limit)
        layer = _Layer(*(getattr(layer, f)[alive] for f in _Layer.__dataclass_fields__))
        layers.append(layer)  # only what continues: every later parent points into it
        if not alive.size:
            break
        cur_j, cur_t, cur_s, cur_room = (layer.strategy, layer.end_time, layer.end_s,
                                         layer.end_room)
        cur_id = np.arange(alive.size)
    out = []
    for g in range(len(goals)):
        path: list[tuple[float, float, ParallelStrategy]] = []
        node = best_node[g]
        if node is not None:
            k, j, t0, parent = node
            path.append((t0, boundaries[k], dp.strats[j]))
            while parent >= 0:
                k -= 1
                layer = layers[k]
                path.append((float(layer.start[parent]), boundaries[k],
                             dp.strats[int(layer.strategy[parent])]))
                parent = int(layer.parent[parent])
        out.append(BoundPath(float(best[g]), path[::-1]))
    return out


Rates = list[tuple[float, float]]  # (global batch tokens, iteration seconds) per strategy


def _kaplan_to_go(dyn: LossCriticalBatch, rates: Rates, s0: float, goals: Sequence[float],
                  boundaries: Sequence[float]) -> ToGo:
    """``int_S^goal dS' / max_b rate_b(S')`` from a table of its left Riemann sums: the
    integrand grows with S (B_crit does), so each sum is below its integral, and a state is
    read at the grid point above it, a goal at the one below: still a lower bound."""
    grid = np.unique(np.concatenate((np.geomspace(s0, max(goals), 400001), goals)))
    bcrit = dyn.b_star / dyn.law.loss(grid) ** (1.0 / value("alpha_B"))
    rate = np.zeros_like(grid)
    for b, t in rates:  # one strategy at a time: a (strategies x grid) array is ~100 MB
        rate = np.maximum(rate, b / t / (b + bcrit))
    cum = np.concatenate(([0.0], np.cumsum(np.diff(grid) / rate[:-1])))  # seconds from s0

    def to_go(s: np.ndarray, d: float, goal: float) -> np.ndarray:
        at = np.minimum(np.searchsorted(grid, s, side="left"), grid.size - 1)
        end = np.searchsorted(grid, goal, side="right") - 1
        return np.maximum(cum[end] - cum[at], 0.0)
    return to_go


class _DataDual:
    """Weak duality for ``B_crit(D)``: for every lambda >= 0 and any strategy sequence from
    tokens D on, ``time >= H_lambda(D) + lambda * (S needed)`` with
    ``H_lambda(D) = int_D^end min(0, min_b [t_b/b - lambda/(b + B_crit(D'))]) dD'``. The
    integrand grows with D', so its left Riemann sums are below the integral, and D is read at
    the grid point below it (more negative area): still a lower bound."""

    def __init__(self, dyn: DataCriticalBatch, rates: Rates, end: float) -> None:
        self.grid = np.concatenate(([0.0], np.geomspace(1.0, max(end, 1.0), 100001)))
        bcrit = dyn.b_crit_many(self.grid)
        self.cost = np.array([t / b for b, t in rates])[:, None]  # seconds per token
        self.gain = np.array([1.0 / (b + bcrit) for b, _ in rates])  # S per token
        self.width = np.diff(self.grid)

    def integrand(self, lam: float) -> tuple[np.ndarray, np.ndarray]:
        """Per grid interval the best ``min(0, t_b/b - lambda gain_b)`` and its S per token."""
        h = self.cost - lam * self.gain
        pick = np.argmin(h, axis=0)[:-1]
        cols = np.arange(pick.size)
        hmin = np.minimum(h[pick, cols], 0.0)
        return hmin, np.where(hmin < 0, self.gain[pick, cols], 0.0)

    def best(self, need: float) -> tuple[float, float]:
        """The largest dual bound from D = 0 for ``need`` S (bisection on lambda where the
        tokens taken give exactly the S needed) and its lambda."""
        def dual(lam: float) -> tuple[float, float]:
            hmin, gain = self.integrand(lam)
            return float(np.sum(hmin * self.width)) + lam * need, float(np.sum(gain * self.width))

        lo, hi, best, arg = 0.0, 1.0, 0.0, 0.0
        while dual(hi)[1] < need:
            hi *= 4.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            g, got = dual(mid)
            if g > best:
                best, arg = g, mid
            lo, hi = (mid, hi) if got < need else (lo, mid)
        for lam in (lo, hi):
            g = dual(lam)[0]
            if g > best:
                best, arg = g, lam
        return best, arg


def _data_to_go(dyn: DataCriticalBatch, rates: Rates, s0: float, goals: Sequence[float],
                boundaries: Sequence[float]) -> ToGo:
    """The dual bound of :class:`_DataDual` at lambdas spread around each goal's best one from
    the start (any lambda gives a bound; the spread keeps it tight from later states)."""
    dual = _DataDual(dyn, rates, boundaries[-1])
    lams = np.unique(np.concatenate([dual.best(g - s0)[1] * np.geomspace(1 / 16, 16, 17)
                                     for g in goals]))
    tails = np.array([np.concatenate((np.cumsum((dual.integrand(lam)[0] * dual.width)[::-1])
                                      [::-1], [0.0])) for lam in lams])  # H_lambda per grid point

    def to_go(s: np.ndarray, d: float, goal: float) -> np.ndarray:
        at = max(int(np.searchsorted(dual.grid, d, side="right")) - 1, 0)
        return np.maximum((tails[:, at, None] + lams[:, None] * (goal - s)[None, :]).max(axis=0),
                          0.0)
    return to_go


TO_GO = {LossCriticalBatch: _kaplan_to_go, DataCriticalBatch: _data_to_go}


def _to_go(dynamics: CriticalBatch, rates: Rates, s0: float, goals: Sequence[float],
           boundaries: Sequence[float]) -> ToGo:
    make = TO_GO.get(type(dynamics))
    if make is None:
        raise ValueError(f"no relaxation registered for {type(dynamics).__name__}")
    return make(dynamics, rates, s0, goals, boundaries)


def relaxed_bound(dynamics: CriticalBatch, strategies: Sequence[ParallelStrategy],
                  seq_length: int, step_time: Callable[[ParallelStrategy], float],
                  goals: Sequence[float], s0: float) -> list[float]:
    """Lower bound on the time to each goal of any strategy sequence (see module doc)."""
    rates = sorted({(s.global_batch_size * seq_length, step_time(s)) for s in strategies})
    to_go = _to_go(dynamics, rates, s0, goals, [0.0, 1e16])  # tokens without end
    return [float(to_go(np.array([s0]), 0.0, goal)[0]) for goal in goals]
