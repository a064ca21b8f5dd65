"""Bounds of the law-based simulation: nothing that moves on the law can be faster.

:func:`relaxed_bound` (what the benchmark asserts against): the fastest time to each target
when the strategy may change continuously and switching is free -- a relaxation of every
chain's problem, so a valid lower bound, computed exactly (quadrature on the law's tables):
for ``B_crit(L)`` the best rate ``max_b (b / t_b) / (b + B_crit(S))`` at every ``S`` (the law
is Markov in S); for ``B_crit(D)`` Lagrangian duality over the tokens seen (weak duality keeps
it a lower bound).

:func:`exact_bound`: the exact dynamic program with the chains' decision cadence and switch
costs (tested equal to brute force); exact but slow at the paper's scales.

The exact DP runs over the decision boundaries every chain uses (token positions
``boundaries``): at each boundary any strategy may follow (switch cost charged; the first choice
is free); one interval advances the law's state exactly (:class:`~megatron_cona.lawsim.law.
CriticalBatch`). A state is dropped when another at the same boundary is at least as far along and early
enough to copy its every continuation (:func:`_prune`: the law's flow is monotone in ``S`` and
the future depends only on (S, D, strategy), D being fixed by the boundary), so the search is
exact;
``snap > 0`` rounds ``S`` UP to a log grid of that relative step (optimistic: still a bound).
The target is hit inside an interval at the exact token count (``tokens_to``).
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


def _snap(s: float, snap: float) -> float:
    return math.exp(math.ceil(math.log(s) / snap) * snap) if snap > 0 else s


def _prune(new: dict[int, list], lead: list[list[float]], limit: float
           ) -> dict[int, list]:
    """Drop every state another one dominates: A (strategy i) dominates B (strategy j) when A
    is at least as far along and ``t_A + lead[i][j] <= t_B``, ``lead[i][j]`` the most that
    leaving i can cost more than leaving j for any next strategy: A follows B's every
    continuation, no later and no less far along (the flow is monotone in S)."""
    states = sorted(((st[1], st[0], j, st) for j, sts in new.items() for st in sts),
                    key=lambda x: (-x[0], x[1]))
    fastest: dict[int, float] = {}  # per strategy, the fastest state kept so far (further along)
    kept: dict[int, list] = {}
    for _, t, j, st in states:
        if t >= limit or any(tf + lead[i][j] <= t for i, tf in fastest.items()):
            continue
        kept.setdefault(j, []).append(st)
        fastest[j] = min(fastest.get(j, math.inf), t)
    return kept


def exact_bound(dynamics: CriticalBatch, boundaries: Sequence[float],
                strategies: Sequence[ParallelStrategy], seq_length: int,
                step_time: Callable[[ParallelStrategy], float],
                switch_time: Callable[[ParallelStrategy, ParallelStrategy], float],
                goals: Sequence[float], s0: float, snap: float = 0.0,
                upper: Sequence[float] | None = None) -> list[BoundPath]:
    """The fastest time to reach each ``S`` in ``goals`` from ``s0`` (see module doc).
    ``upper``: a time per goal some path in this space achieves (e.g. a static chain's);
    states no faster than every one of them are pruned (exactness unchanged)."""
    strats = fastest_micro_batches(strategies, step_time)
    if not strats:
        raise ValueError("strategies: empty")
    n = len(strats)
    batch = [s.global_batch_size * seq_length for s in strats]
    iter_s = [step_time(s) for s in strats]
    switch = [[switch_time(a, b) for b in strats] for a in strats]
    lead = [[max(switch[i][x] - switch[j][x] for x in range(n)) for j in range(n)]
            for i in range(n)]
    best = [math.inf] * len(goals)
    cap = list(upper) if upper is not None else [math.inf] * len(goals)
    best_node: list = [None] * len(goals)
    # a node: (strategy index, start time, start tokens, parent node)
    fronts: dict[int, list[tuple[float, float, object]]] = {j: [(0.0, s0, None)]
                                                           for j in range(n)}
    first = True
    for k in range(len(boundaries) - 1):
        d, tokens = boundaries[k], boundaries[k + 1] - boundaries[k]
        new: dict[int, list[tuple[float, float, object]]] = {}
        limit = max(min(b, c) * (1 + 1e-12) for b, c in zip(best, cap, strict=True))
        for j, front in fronts.items():
            for t, s, node in front:
                advanced: dict[float, float] = {}
                for j2 in ([j] if first else range(n)):
                    t0 = t + (0.0 if first or j2 == j else switch[j][j2])
                    if t0 >= limit:
                        continue
                    b = batch[j2]
                    if b not in advanced:
                        advanced[b] = dynamics.advance(s, d, b, tokens)
                    s2 = advanced[b]
                    here = (j2, t0, d, node)
                    for g, goal in enumerate(goals):
                        if s < goal <= s2:
                            hit = t0 + dynamics.tokens_to(s, d, b, goal) / b * iter_s[j2]
                            if hit < best[g]:
                                best[g], best_node[g] = hit, here
                    t1 = t0 + tokens / b * iter_s[j2]
                    new.setdefault(j2, []).append((t1, _snap(s2, snap), here))
        first = False
        limit = max(min(b, c) * (1 + 1e-12) for b, c in zip(best, cap, strict=True))
        fronts = _prune(new, lead, limit)
        if not fronts:
            break
    out = []
    for g in range(len(goals)):
        path, node = [], best_node[g]
        while node is not None:
            j, t0, d, node = node
            path.append((t0, d, strats[j]))
        out.append(BoundPath(best[g], path[::-1]))
    return out


Rates = list[tuple[float, float]]  # (global batch tokens, iteration seconds) per strategy


def _kaplan_relaxed(dyn: LossCriticalBatch, rates: Rates, s0: float, goal: float) -> float:
    """int dS / max_b rate_b(S); the integrand grows with S (B_crit does), so the left
    Riemann sum on a fine grid is below the integral: still a lower bound."""
    grid = np.geomspace(s0, goal, 200001)
    bcrit = dyn.b_star / dyn.law.loss(grid) ** (1.0 / value("alpha_B"))
    inv = 1.0 / np.max([b / t / (b + bcrit) for b, t in rates], axis=0)  # seconds per S
    return float(np.sum(inv[:-1] * np.diff(grid)))


def _data_relaxed(dyn: DataCriticalBatch, rates: Rates, s0: float, goal: float) -> float:
    """Weak duality: for every lambda >= 0,
    ``g(lambda) = int min(0, min_b [t_b/b - lambda/(b + B_crit(D))]) dD + lambda (goal - s0)``
    is below the fastest time; the integrand grows with D, so its left Riemann sum is below
    the integral. The best lambda is found where the tokens taken give exactly the S needed."""
    need = goal - s0
    grid = np.concatenate(([0.0], np.geomspace(1.0, 1e16, 100001)))
    bcrit = dyn.anchor_bcrit * (grid / dyn.anchor_tokens) ** dyn.exponent
    cost = np.array([t / b for b, t in rates])[:, None]  # seconds per token
    gain = np.array([1.0 / (b + bcrit) for b, _ in rates])  # S per token
    width = np.diff(grid)

    def dual(lam: float) -> tuple[float, float]:
        h = cost - lam * gain
        pick = np.argmin(h, axis=0)[:-1]
        hmin = h[pick, np.arange(pick.size)]
        use = hmin < 0
        got = float(np.sum(gain[pick, np.arange(pick.size)][use] * width[use]))
        return float(np.sum(hmin[use] * width[use])) + lam * need, got

    lo, hi, best = 0.0, 1.0, 0.0
    while dual(hi)[1] < need:
        hi *= 4.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        g, got = dual(mid)
        best = max(best, g)
        lo, hi = (mid, hi) if got < need else (lo, mid)
    return max(best, dual(lo)[0], dual(hi)[0])


RELAXATIONS = {LossCriticalBatch: _kaplan_relaxed, DataCriticalBatch: _data_relaxed}


def relaxed_bound(dynamics: CriticalBatch, strategies: Sequence[ParallelStrategy],
                  seq_length: int, step_time: Callable[[ParallelStrategy], float],
                  goals: Sequence[float], s0: float) -> list[float]:
    """Lower bound on the time to each goal of any strategy sequence (see module doc)."""
    rates = sorted({(s.global_batch_size * seq_length, step_time(s)) for s in strategies})
    relax = RELAXATIONS.get(type(dynamics))
    if relax is None:
        raise ValueError(f"no relaxation registered for {type(dynamics).__name__}")
    return [relax(dynamics, rates, s0, goal) for goal in goals]
