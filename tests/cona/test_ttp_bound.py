"""The DP bound of the TTP evaluation equals a brute-force search over every strategy sequence
on small grids, and is never slower than any static strategy or any sequence."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_cona.ttp.bound import dp_bound
from megatron_cona.ttp.stitch import CurveSet, crossing
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse
INTERVAL = 8


def _curves(rng: random.Random, batches=(2, 4, 8), points=10) -> CurveSet:
    """Random decreasing-ish curves from one initial loss; small batches fast early, large
    batches better late (crossovers), with noise bumps (the envelope handles them)."""
    data = {}
    for b in batches:
        xs = [INTERVAL * k for k in range(points)]
        rate = rng.uniform(0.5, 1.5) / b ** 0.5
        floor = 1.0 + rng.uniform(0, 1) / b
        vs = [floor + 4.0 * math.exp(-rate * k) + rng.uniform(0, 0.05) * (k > 0)
              for k in range(points)]
        data[b] = (xs, vs)
    return CurveSet.from_points(data, INTERVAL)


def _brute(curves, strategies, step_time, switch_time, target, depth):
    """Every sequence of ``depth`` interval choices, simulated step by step."""
    best = math.inf
    for seq in itertools.product(range(len(strategies)), repeat=depth):
        t, loss, prev, x = 0.0, curves.initial_loss, None, 0.0
        for j in seq:
            s = strategies[j]
            b = s.global_batch_size
            if prev is None or prev.global_batch_size != b:
                x = curves.enter(b, loss)
                if x is None:
                    break
                loss = curves.tracks[b].loss_at(x)
            t0 = t + (switch_time(prev, s) if prev is not None else 0.0)
            if x + INTERVAL > curves.tracks[b].end:
                break
            nxt = curves.tracks[b].loss_at(x + INTERVAL)
            t1 = t0 + INTERVAL / b * step_time(s)
            hit = crossing(t0, t1, loss, nxt, target)
            if hit is not None:
                best = min(best, hit)
                break
            t, loss, prev, x = t1, nxt, s, x + INTERVAL
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dp_bound_equals_brute_force(seed):
    rng = random.Random(seed)
    curves = _curves(rng)
    strategies = [P("dp2tp1pp1mb1gb2"), P("dp1tp2pp1mb1gb4"), P("dp2tp1pp1mb2gb4"),
                  P("dp2tp1pp1mb4gb8")]
    times = {s: rng.uniform(0.5, 2.0) * (1 + s.global_batch_size / 8) for s in strategies}
    costs = {(a, b): 0.0 if a == b else rng.uniform(0.05, 1.0)
             for a in strategies for b in strategies}
    target = curves.initial_loss - rng.uniform(2.0, 3.0)
    depth = 6
    brute = _brute(curves, strategies, times.__getitem__, lambda a, b: costs[a, b], target,
                   depth)
    assert math.isfinite(brute), "grid too short for the target"
    result = dp_bound(curves, strategies, times.__getitem__, lambda a, b: costs[a, b], target)
    assert result.time == pytest.approx(brute, rel=1e-12)
    # the path it reports really takes that time
    assert result.path[0][0] == 0.0
    # never slower than any static strategy (each static is one path)
    for s in strategies:
        static = _brute(curves, [s], times.__getitem__, lambda a, b: costs[a, b], target, 9)
        assert result.time <= static + 1e-12


def test_snap_keeps_a_bound_and_prefers_the_crossover():
    rng = random.Random(11)
    curves = _curves(rng)
    strategies = [P("dp2tp1pp1mb1gb2"), P("dp2tp1pp1mb2gb4"), P("dp2tp1pp1mb4gb8")]
    times = {s: 1.0 + s.global_batch_size / 16 for s in strategies}
    target = curves.initial_loss - 2.5
    exact = dp_bound(curves, strategies, times.__getitem__, lambda a, b: 0.01, target)
    snapped = dp_bound(curves, strategies, times.__getitem__, lambda a, b: 0.01, target,
                       snap=0.05)
    assert snapped.time <= exact.time + 1e-12  # snapping is optimistic: still a bound
    assert snapped.time > 0.5 * exact.time


def test_unreachable_target_is_inf():
    curves = CurveSet.from_points({2: ([0, 8, 16], [5.0, 4.0, 3.5])}, INTERVAL)
    res = dp_bound(curves, [P("dp2tp1pp1mb1gb2")], lambda s: 1.0, lambda a, b: 0.0, 1.0)
    assert res.time == math.inf
