import json

import numpy as np
import pytest

from megatron_cona.goodput import CalibratedThroughput, estimate, rank
from megatron_cona.policy import (
    DecisionLog,
    PolicyConfig,
    PolicyError,
    SwitchCostModel,
    SwitchPolicy,
    payback_time,
)
from predictors.spec import ParallelStrategy

A = ParallelStrategy.parse("dp4tp1pp1mb1gb8")
B = ParallelStrategy.parse("dp2tp2pp1mb2gb16")
C = ParallelStrategy.parse("dp4tp1pp1mb2gb16")  # same layout as A: batch-only switch


def est(strategy, goodput):
    return estimate(strategy, strategy.global_batch_size / goodput, float("nan"), 8)


def test_payback_time_closed_form():
    # best 2x current, 1 s lost: after 2 s both paths did the same work
    assert payback_time(1.0, 2.0, 1.0) == pytest.approx(2.0)
    assert payback_time(2.0, 1.0, 1.0) == float("inf")


def test_switches_after_patience_when_clearly_better(tmp_path):
    policy = SwitchPolicy(PolicyConfig(min_gain=0.05, patience=2, horizon_intervals=10))
    log = DecisionLog(tmp_path / "cona.jsonl")
    cur = est(A, 100.0)
    ranking = [est(B, 150.0), cur]
    d1 = policy.decide(50, cur, ranking, interval_s=5.0)
    log.write(d1)
    assert not d1.switch and "1/2" in d1.reason
    d2 = policy.decide(100, cur, ranking, interval_s=5.0)
    log.write(d2)
    assert d2.switch and d2.target == B and d2.gain == pytest.approx(0.5)
    lines = [json.loads(x) for x in (tmp_path / "cona.jsonl").read_text().splitlines()]
    assert [x["switch"] for x in lines] == [False, True]
    assert lines[1]["best"]["strategy"] == B.name and lines[1]["switch_cost_s"] == 1.0


def test_small_gain_or_unrepaid_cost_does_not_switch():
    policy = SwitchPolicy(PolicyConfig(min_gain=0.1, patience=1))
    cur = est(A, 100.0)
    d = policy.decide(1, cur, [est(B, 105.0), cur], interval_s=5.0)
    assert not d.switch and "min_gain" in d.reason
    # 20% better, but a 60 s switch is repaid only after 360 s > 20 intervals * 5 s
    costly = SwitchPolicy(PolicyConfig(min_gain=0.1, patience=1), SwitchCostModel(60.0))
    d = costly.decide(1, cur, [est(B, 120.0), cur], interval_s=5.0)
    assert not d.switch and "horizon" in d.reason
    # the same gain by a batch-only change (cheap) is taken
    d = costly.decide(2, cur, [est(C, 120.0), cur], interval_s=5.0)
    assert d.switch and d.target == C


def test_measured_cost_replaces_prior():
    costs = SwitchCostModel(layout_prior_s=1.0)
    costs.record(A, B, 7.0)
    assert costs.estimate(A, B) == 7.0
    assert costs.estimate(A, C) == costs.batch_prior_s


def test_a_timed_build_prices_the_first_layout_switch():
    """A job that took 60 s to build its state is not moved to another layout for a gain a
    60 s switch does not repay (the default 1 s prior would take it); a build faster than the
    default leaves the default, since a switch does more than build; a measured switch then
    replaces either."""
    cur = est(A, 100.0)
    ranking = [est(B, 120.0), cur]
    slow = SwitchCostModel.for_build(60.0)
    assert slow.estimate(A, B) == 60.0 and slow.estimate(A, C) == slow.batch_prior_s
    d = SwitchPolicy(PolicyConfig(min_gain=0.1, patience=1), slow).decide(
        1, cur, ranking, interval_s=5.0)
    assert not d.switch and "horizon" in d.reason and d.switch_cost_s == 60.0
    d = SwitchPolicy(PolicyConfig(min_gain=0.1, patience=1),
                     SwitchCostModel.for_build(None)).decide(1, cur, ranking, interval_s=5.0)
    assert d.switch and d.switch_cost_s == 1.0
    assert SwitchCostModel.for_build(0.05).estimate(A, B) == 1.0
    slow.record(A, B, 7.0)
    assert slow.estimate(A, B) == 7.0


def test_no_flapping_under_noise():
    """Two strategies with equal true goodput, measured with 5% noise: never switch back and
    forth; with a real 30% advantage hidden in the same noise it switches exactly once."""
    rng = np.random.default_rng(0)

    def run(true_b):
        policy = SwitchPolicy(PolicyConfig(min_gain=0.1, patience=2, cooldown=1))
        current, switches = A, 0
        for it in range(200):
            noisy = {A: 100.0 * rng.lognormal(0, 0.05), B: true_b * rng.lognormal(0, 0.05)}
            ranking = sorted((est(s, g) for s, g in noisy.items()), key=lambda e: -e.goodput)
            cur = next(e for e in ranking if e.strategy == current)
            d = policy.decide(it, cur, ranking, interval_s=10.0)
            if d.switch:
                switches += 1
                current = d.target
        return switches, current

    assert run(100.0)[0] == 0
    switches, final = run(130.0)
    assert switches == 1 and final == B


class Linear:
    def iteration_time(self, s):
        return 0.01 + 0.01 * s.global_batch_size / s.dp  # fixed overhead + per-sample


def test_ranking_uses_measured_then_calibrated_times():
    times = CalibratedThroughput(Linear())
    assert times.source(B) == "predicted"
    times.record(A, 0.06)  # predicted 0.03: this machine is 2x slower than predicted
    assert times.iteration_time(A) == pytest.approx(0.06)
    assert times.source(A) == "measured"
    assert times.iteration_time(B) == pytest.approx(2 * (0.01 + 0.01 * 16 / 2))
    assert times.source(B) == "calibrated"
    ranked = rank([A, B, C], times, noise_scale=1e6, base_batch=8)
    assert [e.goodput for e in ranked] == sorted((e.goodput for e in ranked), reverse=True)
    # with a huge noise scale efficiency ~ 1, so the larger batch amortising overhead wins
    assert ranked[0].strategy == C


def test_bad_config_named():
    with pytest.raises(PolicyError, match="min_gain"):
        PolicyConfig(min_gain=-1)
    with pytest.raises(PolicyError, match="patience"):
        PolicyConfig(patience=0)


def test_predicted_candidate_must_beat_its_uncertainty():
    from megatron_cona.goodput import GoodputEstimate

    cur = est(A, 100.0)
    shaky = GoodputEstimate(B, 16 / 120.0, 120.0, 1.0, 120.0, "calibrated", uncertainty=0.3)
    policy = SwitchPolicy(PolicyConfig(min_gain=0.05, patience=1))
    d = policy.decide(1, cur, [shaky, cur], interval_s=100.0)
    assert not d.switch and "uncertainty 0.300" in d.reason
    sure = GoodputEstimate(B, 16 / 120.0, 120.0, 1.0, 120.0, "measured", uncertainty=0.0)
    assert policy.decide(2, cur, [sure, cur], interval_s=100.0).switch


def test_uncertainty_is_the_prior_then_the_calibration_spread_without_a_floor():
    times = CalibratedThroughput(Linear(), prior_error=0.07)
    assert times.uncertainty(B) == 0.07  # the predictor's held-out error until 3 measured
    times.record(A, 0.06)  # 2x the prediction
    times.record(C, 0.05)  # 1x the prediction
    assert times.uncertainty(B) == 0.07
    assert times.uncertainty(A) == 0.0
    d = ParallelStrategy.parse("dp4tp1pp1mb1gb16")
    times.record(d, 0.05 * 1.5)  # 1.5x
    ratios = [times.measured[s] / times.predicted(s) for s in (A, C, d)]
    assert times.uncertainty(B) == pytest.approx(np.expm1(np.std(np.log(ratios), ddof=1)))
    # an exact predictor calibrates to no uncertainty (no fixed floor)
    exact = CalibratedThroughput(Linear(), prior_error=0.07)
    for s in (A, C, d):
        exact.record(s, exact.predicted(s))
    assert exact.uncertainty(B) == pytest.approx(0.0, abs=1e-12)
