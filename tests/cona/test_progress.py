"""The progress check of batch switches (megatron_cona.progress) and the session's use of it:
scripted loss readings on known dynamics, so every expected number follows from the law."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_cona.executor import SingleProcessExecutor, SwitchOutcome
from megatron_cona.gns import GradientNoiseScale, GradStats, measures_noise
from megatron_cona.goodput import CalibratedThroughput
from megatron_cona.lawsim.clock import TableThroughput
from megatron_cona.policy import PolicyConfig, SwitchPolicy
from megatron_cona.progress import (
    OLD_HISTORY,
    ProgressMonitor,
    fit_rate,
    implied_noise_scale,
)
from megatron_cona.session import ConaSession, SessionConfig
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse


def test_fit_rate_recovers_a_slope_and_its_error():
    rng = np.random.default_rng(0)
    t = np.linspace(0, 10, 200)
    loss = 5.0 - 0.3 * t + rng.normal(0, 0.05, t.size)
    rate, se, _, _ = fit_rate(list(t), list(loss))
    assert abs(rate - 0.3) < 4 * se and 0 < se < 0.01
    assert math.isnan(fit_rate([0.0, 1.0], [1.0, 0.9])[0])


def test_a_rate_is_filed_under_the_loss_at_its_own_time():
    """On a bending curve (early training) the readings' mean loss lies above the loss where
    the fitted slope is taken; a pooled rate filed under the mean was compared with the old
    strategy's rate at too high a loss. Noiseless L = 10 - 0.2 t + 0.004 t^2 over t in
    [0, 20]: the rate, 0.12 per second, belongs to L(t0) = 8.4 at the mean time t0 = 10, not
    to the readings' mean 8.54 (the loss of 1.2 seconds earlier)."""
    m = ProgressMonitor()
    for t in np.linspace(0.0, 20.0, 41):
        m.observe(float(t), 10.0 - 0.2 * t + 0.004 * t * t, 0.5, 0.5)
    r = m.close_interval(P("dp4tp1pp1mb4gb16"))
    assert r.mid_time == pytest.approx(10.0)
    assert r.value == pytest.approx(0.2 - 0.008 * 10.0, rel=1e-9)
    assert r.mid_loss == pytest.approx(10.0 - 2.0 + 0.4, abs=1e-9)


def test_a_comparison_with_a_vanishing_old_rate_teaches_nothing_and_does_not_crash():
    """An old rate extrapolated to nearly 0 (a bend fitted to noise) makes the comparison's
    errors ~1e300: their squares overflowed a float (the grid crashed once on it). The
    evidence is weightless: the posterior stays the prior."""
    from megatron_cona.progress import Evidence

    m = ProgressMonitor()
    prior = (m.bias, m.bias_sd)
    m._evidence.append(Evidence(1.0, 16, 32, 4.0, observed=1e298, new_error=1e300,
                                old_relative_error=1e3))
    m._update_posterior()
    assert (m.bias, m.bias_sd) == pytest.approx(prior, rel=1e-6)


def test_implied_noise_scale_inverts_the_efficiency_ratio():
    phi, b_old, b_new = 300.0, 64, 16
    e = (phi + b_old) / (phi + b_new)
    assert implied_noise_scale(e, b_old, b_new) == pytest.approx(phi)
    assert implied_noise_scale(e * 10, b_old, b_new) != implied_noise_scale(e * 10, b_old, b_new)


def _feed(monitor, strategy, rate_at, t0, t1, seconds_per_sample, n=40, noise=0.0, rng=None):
    """Readings of a loss falling at ``rate_at(t)`` per second between t0 and t1."""
    ts = np.linspace(t0, t1, n)
    loss = 10.0 - np.array([rate_at(t) for t in ts]) * ts
    if noise:
        loss = loss + rng.normal(0, noise, n)
    for t, v in zip(ts, loss, strict=True):
        monitor.observe(float(t), float(v), (t1 - t0) / n, (t1 - t0) / n / seconds_per_sample)
    return monitor.close_interval(strategy)


def test_a_switch_that_lost_progress_is_rolled_back_and_teaches_the_bias():
    """Old batch 64 at 1 s/sample-unit, new batch 16 twice as fast per sample but the true
    noise scale is 300 (the probe said 3: bias 100): efficiency (300+64)/(300+16) = 1.152, so
    progress per second is 1.152 x 0.5 of the old one's -- the switch lost."""
    old, new = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb1gb16")
    m = ProgressMonitor()
    _feed(m, old, lambda t: 0.01, 0, 100, 1.0)
    _feed(m, old, lambda t: 0.01, 100, 200, 1.0)
    e = (300 + 64) / (300 + 16)
    _feed(m, new, lambda t: 0.01 * 0.5 * e, 200, 300, 2.0)
    v = m.judge(old, new, probe_phi=3.0)
    m.learn(v)
    assert v.rollback and not v.paid
    assert v.observed == pytest.approx(0.5 * e, rel=1e-6)
    assert v.noise_scale == pytest.approx(300, rel=1e-3)
    assert m.bias == pytest.approx(100, rel=0.05) and m.calibrated


def test_a_switch_after_one_interval_on_the_old_strategy_is_judged():
    """The ranking may move after a single interval on a strategy (the grid's traced worst
    case: 32 -> 128 after one interval on 32, on a bias one comparison had pinned 5x too
    high). Its readings are enough to extrapolate the old rate (a cubic needs five), so the
    move is judged like any other, not taken on the ranking's word: the same lost switch as
    above, with one interval before it, is rolled back. Four readings are too few: no
    verdict."""
    old, new = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb1gb16")
    e = (300 + 64) / (300 + 16)
    m = ProgressMonitor()
    _feed(m, old, lambda t: 0.01, 0, 100, 1.0)
    _feed(m, new, lambda t: 0.01 * 0.5 * e, 100, 200, 2.0)
    v = m.judge(old, new, probe_phi=3.0)
    assert v is not None and v.rollback
    assert v.observed == pytest.approx(0.5 * e, rel=1e-6)
    m = ProgressMonitor()
    _feed(m, old, lambda t: 0.01, 0, 100, 1.0, n=4)
    _feed(m, new, lambda t: 0.01 * 0.5 * e, 100, 200, 2.0)
    assert m.judge(old, new, probe_phi=3.0) is None


def test_a_switch_as_predicted_is_kept_and_leaves_the_bias_near_one():
    """Batch 64 -> 128 at 1.6x the throughput per sample with the probe's phi = 50 right:
    progress x 1.6 (50+64)/(50+128) = 1.02, read through noisy losses."""
    rng = np.random.default_rng(1)
    old, new = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb4gb128")
    m = ProgressMonitor()
    for k in range(2):
        _feed(m, old, lambda t: 0.01, 100 * k, 100 * (k + 1), 1.0, noise=0.02, rng=rng)
    _feed(m, new, lambda t: 0.01 * 1.6 * 114 / 178, 200, 300, 1 / 1.6, noise=0.02, rng=rng)
    v = m.judge(old, new, probe_phi=50.0)
    m.learn(v)
    assert v.paid and not v.rollback
    assert 0.3 < m.bias < 3


@pytest.mark.parametrize("centre", [1e-3, 1.0, 10.0, 1e3, 1e6])
def test_the_prior_on_the_bias_keeps_its_shape_wherever_it_is_centred(centre):
    """A job that measured its own ratio sets the prior's centre (``--cona-probe-bias``): before
    any comparison the posterior is that prior, neither cut off nor shifted by a fixed range."""
    m = ProgressMonitor(prior_bias=centre)
    assert m.bias == pytest.approx(centre, rel=1e-6)
    assert m.bias_sd == pytest.approx(ProgressMonitor(prior_bias=10.0).bias_sd, rel=1e-9)
    assert m.bias_sd == pytest.approx(m.prior_sd, rel=0.02)
    nodes = m.bias_nodes
    assert sum(w for _, w in nodes) == pytest.approx(1.0)
    ln_mean = sum(w * math.log(k) for k, w in nodes)
    assert ln_mean == pytest.approx(math.log(centre), abs=1e-3)  # nodes drop the last ~1e-4


class _Exec(SingleProcessExecutor):
    def switch(self, target):
        self._strategy = target
        return SwitchOutcome(True, 0.0, moved_tensors=False)

    def set_lr_scale(self, scale):
        self.lr_scale = scale


def _session(candidates, times, **config):
    table = {s: times[s] for s in candidates}
    return ConaSession(candidates, CalibratedThroughput(TableThroughput(table), prior_error=0.0),
                       SwitchPolicy(PolicyConfig(min_gain=0.01, patience=1, cooldown=0)),
                       GradientNoiseScale(0.9), SessionConfig(interval=1, base_batch=64,
                                                              lr_rule="adascale", **config),
                       _Exec(candidates[0]))


def _replicas_reading(phi, batch):
    """Probe statistics of 4 replicas whose gradients read the noise scale ``phi`` exactly:
    |G|^2 = 1, tr(S) = phi."""
    local = batch // 4
    return GradStats([1 + phi / local] * 4, local, 1 + phi / batch, batch)


def _run_intervals(s, secs, rate, probe_phi, intervals, iterations=20):
    """``intervals`` rankings of ``iterations`` iterations each, the loss falling at
    ``rate(strategy)`` per second with 1e-5 of reading noise, the probe reading ``probe_phi``:
    the strategy after each ranking."""
    rng = np.random.default_rng(0)
    loss, path = 10.0, []
    for _ in range(intervals):
        now = s.executor.strategy
        for _ in range(iterations):
            loss -= rate(now) * secs[now]
            s.observe(secs[now], _replicas_reading(probe_phi, now.global_batch_size),
                      loss=loss + float(rng.normal(0, 1e-5)))
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
    return path


def test_session_rolls_back_a_switch_that_did_not_pay_and_does_not_retry_it():
    """Scripted readings: the probe's noise scale says 3, so batch 16 (half the throughput of
    batch 64) looks 1.8x better; the true noise scale is 300, so progress per second on batch
    16 is 0.5 x (300+64)/(300+16) = 0.58 of batch 64's: the session rolls back, learns the
    probe's bias from the comparison and does not try batch 16 again."""
    big, small = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb1gb16")
    secs = {big: 1.0, small: 0.5}
    s = _session([big, small], secs, explore_after=0)

    rate = {big: 0.01, small: 0.01 * 0.5 * (300 + 64) / (300 + 16)}
    t, loss, path = 0.0, 10.0, []
    for k in range(7):
        now = s.executor.strategy
        for _ in range(20):
            t += secs[now]
            loss -= rate[now] * secs[now]
            # no probe reading in the first two intervals: the old rate's trend is measured
            s.observe(secs[now], _replicas_reading(3, now.global_batch_size) if k >= 2 else None,
                      loss=loss)
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
    assert path[:2] == [big, big]
    assert path[2] == small  # the probe's estimate sent it there
    assert path[3] == big  # the progress check brought it back
    assert all(p == big for p in path[4:])
    v = s.progress.verdicts[0]
    assert v.rollback and v.noise_scale == pytest.approx(300, rel=1e-3)
    assert s.progress.bias == pytest.approx(100, rel=0.05) and small in s.tried


def test_blind_layouts_wait_for_a_converged_estimate():
    assert not measures_noise(1, 1) and measures_noise(1, 2) and measures_noise(2, 1)
    run, blind = P("dp2tp1pp1mb2gb8"), P("dp1tp1pp2mb4gb4")
    assert not measures_noise(blind.dp, blind.num_microbatches)
    s = _session([run, blind], {run: 1.0, blind: 0.1})
    s.act(0, s.decide(0))  # no estimate at all: the blind layout is not open
    assert s.executor.strategy == run


def test_an_experiment_finds_a_biased_probe_out_and_keeps_the_larger_batch():
    """The probe reads phi = 4 (true phi = 400: k = 100), so batch 16 ranks first, with the
    efficiency averaged over the prior on the probe's bias too. After ``explore_after``
    rankings CONA tries batch 32 (1.4x the throughput per sample here), holds it while the
    comparison is unsure, sees progress x1.4 x (400+16)/(400+32) = 1.35 of batch 16's, keeps
    it and learns that the probe reads low."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}  # per iteration: 32 samples in 1.43 s vs 16 in 1 s
    s = _session([small, big], secs, explore_after=3)

    def rate(strategy):  # loss per second: throughput x Pollux's efficiency at phi = 400
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (400 + 16) / (400 + b)

    path = _run_intervals(s, secs, rate, 4, 9)
    assert path[:3] == [small] * 3  # the probe's ranking: batch 16
    assert path[3] == big  # the experiment, confident after one interval
    assert path[4] == small  # bracketed: one interval back on 16
    assert all(p == big for p in path[5:])  # gone back to and kept: it paid
    v = s.progress.verdicts[0]
    assert v.confident and v.paid and v.observed == pytest.approx(1.35, rel=0.05)
    assert s.progress.bias > 10 and small in s.tried


@pytest.mark.parametrize("switch_s, experiments", [(0.01, True), (200.0, False)])
def test_an_experiment_is_not_worth_switches_that_cost_more_than_it_can_teach(switch_s,
                                                                               experiments):
    """The scenario above, where an experiment to batch 32 finds the probe 100x low. But
    where a batch switch costs 200 s (measured: the switch cost model's record) against
    20 s intervals, going there, back (the bracket) and there again costs more than knowing
    the bias could repay over the policy's horizon: no experiment runs. With switches of
    10 ms it runs as before. (Before, an experiment ignored switch costs: `cona scale
    --switch-costs 0,3600` made CONA pay hour-long batch switches to experiment.)"""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}
    s = _session([small, big], secs, explore_after=3)
    s.policy.costs.record(small, big, switch_s)

    def rate(strategy):  # loss per second: throughput x Pollux's efficiency at phi = 400
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (400 + 16) / (400 + b)

    path = _run_intervals(s, secs, rate, 4, 9)
    assert (big in path) == experiments
    assert path[:3] == [small] * 3


def test_a_bracket_whose_intervals_are_too_short_for_a_rate_still_judges_the_experiment():
    """The scenario above with two iterations an interval (``--cona-interval 2``): no interval
    has a rate of its own, each joins the next on its strategy. The interval back on 16 is
    counted once it has a rate, so the bracket still ends in a verdict: the experiment finds
    the probe 100x low and CONA goes back to 32. (Counted by rankings, the bracket ended on an
    interval without a rate, judged nothing and stayed on 16 with the bias unlearned.)"""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}
    s = _session([small, big], secs, explore_after=3)

    def rate(strategy):  # loss per second: throughput x Pollux's efficiency at phi = 400
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (400 + 16) / (400 + b)

    path = _run_intervals(s, secs, rate, 4, 30, iterations=2)
    assert big in path and path[-1] == big
    assert s.progress.verdicts and s.progress.verdicts[0].new == big
    assert s.progress.bias > 10


def test_an_experiment_tries_a_smaller_batch_when_the_prior_sits_above_the_truth():
    """The probe reads phi = 8 and is right (k = 1), but the default prior (centred on 10)
    ranks batch 64 first. The plausible low end of the bias would pick batch 16 and the high
    end nothing larger than 64, so the experiment halves the batch: batch 32 makes
    (32/1.4) x 24/40 = 13.7 of progress against batch 64's 32 x 24/72 = 10.7, the comparison
    says k is near 1 and CONA goes on down to batch 16 (16 x 24/24 = 16). A doubling
    experiment would have had no larger batch to try and left the job on 64 for good."""
    big, mid, small = P("dp4tp1pp1mb16gb64"), P("dp4tp1pp1mb8gb32"), P("dp4tp1pp1mb4gb16")
    secs = {big: 2.0, mid: 1.4, small: 1.0}
    s = _session([big, mid, small], secs, explore_after=2)

    def rate(strategy):  # loss per second: throughput x Pollux's efficiency at phi = 8
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (8 + 16) / (8 + b)

    path = _run_intervals(s, secs, rate, 8, 10)
    first = path.index(mid)
    assert path[:first] == [big] * first and 2 <= first <= 3  # the prior's pick, then halved
    assert path[-1] == small  # the comparison taught k ~ 1: on down to batch 16
    v = s.progress.verdicts[0]
    assert (v.old, v.new) == (big, mid) and v.confident and v.paid
    assert s.progress.bias < 3 and big in s.tried


@pytest.mark.parametrize("prior, chosen", [(None, "gb64"), (1.0, "gb16")])
def test_before_any_comparison_the_ranking_hedges_towards_published_biases(prior, chosen):
    """The probe reads phi = 8. Were it the critical batch, batch 64 (2x the samples per
    second of batch 16) would make 2 x (8+16)/(8+64) = 0.67 of batch 16's progress; at the
    published 10-100x (Merrill et al. 2025) it makes 1.33-1.89x. With no comparison yet the
    default prior, centred on the published ratios' middle, ranks batch 64 first; a job that
    centres it on its probe (``probe_bias_prior=1``) stays on batch 16."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb16gb64")
    secs = {small: 1.0, big: 2.0}
    s = _session([small, big], secs, confirm=False,
                 **({} if prior is None else {"probe_bias_prior": prior}))
    for _ in range(20):
        s.observe(1.0, _replicas_reading(8.0, 16), loss=10.0)
    assert s.decide(0).best.strategy.name.endswith(chosen)


def test_no_return_below_a_batch_a_larger_one_was_measured_to_beat():
    """The probe reads phi = 4, so batch 16 ranks first and batch 8 (slower per sample)
    second. An experiment moves to batch 32 and its comparison says it paid, but teaches
    nothing about the probe's bias (a verdict without evidence): the ranking still puts batch
    8 above 32. Batch 16 was measured worse, and batch 8, no faster per sample, lies below
    it: CONA stays on 32 until the noise scale falls below half of what it was."""
    from megatron_cona.progress import Verdict

    small, big, tiny = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32"), P("dp4tp1pp1mb2gb8")
    secs = {small: 1.0, big: 1.0 / 0.7, tiny: 0.9}  # samples/s: 16, 22.4, 8.9
    # the prior centred on the probe's reading, so that its ranking is the scenario's; the
    # experiment unbracketed (a floor is set by the verdict, however it was read)
    s = _session([small, big, tiny], secs, explore_after=2, probe_bias_prior=1.0, bracket=0)
    s.progress.judge = lambda old, new, phi, seen, back=0: Verdict(
        old, new, 1.3, 0.1, 0.9, math.nan, paid=True, rollback=False, confident=True)
    phi = {"now": 4.0}

    path, prefers_tiny = [], []
    for i in range(10):
        if i == 7:
            phi["now"] = 1.5  # below half of 4: what was measured no longer holds
        now = s.executor.strategy
        for _ in range(20):
            s.observe(secs[now], _replicas_reading(phi["now"], now.global_batch_size),
                      loss=10.0 - 0.01 * i)
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
        prefers_tiny.append(s.current_estimate(tiny).goodput > s.current_estimate(big).goodput)
    first = path.index(big)
    assert 0 < first < 7 and path[:first] == [small] * first  # the probe's ranking, then 32
    assert path[first:7] == [big] * (7 - first)  # neither back to 16 nor down to 8 ...
    assert all(prefers_tiny[first:7])  # ... though the estimate puts 8 above 32
    assert path[7] != big  # the floor lifts once the noise scale fell 2x


@pytest.mark.parametrize("below_pays", [False, True])
def test_a_floor_binds_until_the_training_time_doubled_then_a_move_below_it_must_pay(
        below_pays):
    """The scenario above with the noise scale steady at 4: the floor an experiment's verdict
    set (batch 32 beat 16) binds while the training time since it has not doubled, though the
    estimate puts batch 8 above 32. Then the ranking's move below it is made as an experiment:
    a comparison that says it lost sends CONA back to 32, the floor binding again from then;
    one that says it paid lifts the floor and CONA stays. A floor set by a verdict read wrong
    through the loss's noise is measured again instead of binding for the rest of the run."""
    from megatron_cona.progress import Verdict

    small, big, tiny = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32"), P("dp4tp1pp1mb2gb8")
    secs = {small: 1.0, big: 1.0 / 0.7, tiny: 0.9}
    s = _session([small, big, tiny], secs, explore_after=2, probe_bias_prior=1.0, bracket=0)

    def judge(old, new, phi, seen, back=0):
        up = new.global_batch_size > old.global_batch_size
        ratio = 1.3 if up or below_pays else 0.7
        return Verdict(old, new, ratio, 0.1, ratio, math.nan, paid=ratio > 1,
                       rollback=ratio < 1, confident=True)

    s.progress.judge = judge
    path, stale, floors = [], [], []
    for i in range(16):
        now = s.executor.strategy
        for _ in range(20):
            s.observe(secs[now], _replicas_reading(4.0, now.global_batch_size),
                      loss=10.0 - 0.01 * i)
        stale.append(s._floor_stale())
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
        floors.append(s._floor)
    first, challenged = path.index(big), stale.index(True)
    assert first < challenged - 1
    # held on 32 from the verdict that set the floor until the training time doubled ...
    assert path[first:challenged] == [big] * (challenged - first)
    assert path[challenged] == tiny  # ... then the ranking's move below it, an experiment
    if below_pays:
        assert path[challenged:] == [tiny] * (len(path) - challenged)
        assert floors[-1] is None and big in s.tried
    else:
        assert path[challenged + 1] == big and tiny in s.tried
        renewed = floors[challenged + 1]
        assert renewed[0] == small and renewed[2] > floors[challenged - 1][2]


def test_an_experiment_waits_until_its_comparison_can_be_confident():
    """The same biased probe, but the loss readings are so noisy against 20 iterations'
    progress (sd 3 nats vs 0.32 nats of progress an interval) that even a comparison of
    four intervals on each side could not tell 2x apart: CONA does not spend intervals on an
    experiment that cannot teach (the wait is not doubled either). Once the readings the
    comparison extrapolates from are clean the experiment runs and finds the bias."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}
    s = _session([small, big], secs, explore_after=3)

    rng = np.random.default_rng(0)
    loss, path, waits = 10.0, [], []
    for i in range(16):
        now = s.executor.strategy
        noise = 3.0 if i < 8 else 1e-5
        for _ in range(20):
            b = now.global_batch_size
            loss -= 1e-3 * (b / secs[now]) * (400 + 16) / (400 + b) * secs[now]
            s.observe(secs[now], _replicas_reading(4, b), loss=loss + float(rng.normal(0, noise)))
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
        waits.append(s._explore_wait)
    first = path.index(big)
    assert path[:8] == [small] * 8 and waits[:first] == [3] * first  # postponed, not given up
    # once the run it reads from is clean: the experiment, bracketed (one interval back on
    # 16), judged, gone back to; the bias found
    assert 8 <= first < 8 + OLD_HISTORY and path[first:].count(small) == 1
    assert path[-1] == big
    assert s.progress.verdicts and s.progress.verdicts[0].new == big
    assert s.progress.calibrated and s.progress.bias == pytest.approx(100, rel=0.1)


def test_a_comparison_far_past_the_old_rates_teaches_less():
    """The old strategy's rate is extrapolated from its last two intervals to the loss the new
    one reached; the farther that is, the more the old rates' errors grow on the way, and the
    less the comparison may say about the probe's bias. Same readings, same new rate: the new
    interval far past the old ones leaves the posterior of ln k wider than the near one."""
    old, new = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb4gb128")
    spreads = []
    for start in (200, 600):
        rng = np.random.default_rng(5)
        m = ProgressMonitor()
        _feed(m, old, lambda t: 0.012, 0, 100, 1.0, noise=0.02, rng=rng)
        _feed(m, old, lambda t: 0.010, 100, 200, 1.0, noise=0.02, rng=rng)
        _feed(m, new, lambda t: 0.009, start, start + 100, 1 / 1.6, noise=0.02, rng=rng)
        m.learn(m.judge(old, new, probe_phi=64.0))
        spreads.append(m.bias_sd)
    assert spreads[1] > spreads[0] * 1.05


def test_a_comparison_pools_the_old_run_so_its_verdict_is_unbiased_and_its_error_honest():
    """A power-law loss curve, ``L = 2 + 5 (1 + t/100)^-1/2``, read through noise of 0.01
    nats at 8 readings an interval (an interval's progress is ~0.1 nats: early training's
    short intervals). After four intervals the strategy changes to one that makes 0.8x the
    progress per second at every loss. Over 200 seeds the comparison (the old run's readings
    pooled and extrapolated to the new run's loss) finds 0.8 without bias, and the error it
    states covers the truth as a standard error should. Two intervals' separate rates, the
    earlier design, were off by 24% (median) and covered the truth at 2 errors 64% of the
    time."""
    old, new = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    rho, found = 0.8, []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        m, t = ProgressMonitor(), 100.0
        for strategy in [old] * 4 + [new] * 4:
            for now in np.linspace(t, t + 20, 8, endpoint=False) + 1.25:
                # y = (L - 2) / 5: on the old strategy dy/dt = -0.005 y^3, on the new rho x it
                y = ((1 + now / 100) if now < 180 else (2.8 + 0.01 * rho * (now - 180))) ** -0.5
                m.observe(float(now), 2 + 5 * y + 0.01 * rng.normal(), 2.5, 2.5)
            m.close_interval(strategy)
            t += 20
        v = m.judge(old, new, 10.0, 4)
        found.append((v.observed / rho, v.stderr / rho))
    ratio, error = np.array(found).T
    assert abs(np.median(ratio) - 1) < 0.03
    assert np.median(np.abs(np.log(ratio))) < 0.1
    assert 0.85 <= np.mean(np.abs(ratio - 1) < 2 * error) <= 0.99


def test_a_comparison_across_a_learning_rate_decay_reads_the_strategy_not_the_schedule():
    """A real job's learning rate decays, so the old strategy's progress at a given loss is
    not what it was before the switch. The power law of the test above with the LR (and so
    the progress per second) falling linearly to 0.4x between t = 100 and 300 s: the trial
    (0.8x the old strategy's progress at every moment) runs four intervals from t = 180.
    Against raw training time the decay reads as the strategy's doing: extrapolated from the
    old run before the switch, the trial reads >= 8% worse than it is, its stated error
    covering the truth < 70% of the time; bracketed by one interval back on the old strategy
    (the power-law interpolation sags below the chord, as the decay does) >= 5% better.
    Against the session's clock, training time weighted by the LR schedule's factor, both are
    within 6% at the median (noiseless: 0.99 and 1.00; the readings' noise reads a bracket's
    one interval back a few percent slow) and their errors cover the truth as standard errors
    should."""
    old, new = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    rho = 0.8
    grid = np.linspace(0.0, 320.0, 64001)
    lr = np.clip(1 - 0.003 * (grid - 100), 0.4, 1.0)

    def integral(f):
        return np.concatenate(([0.0], np.cumsum((f[1:] + f[:-1]) / 2 * np.diff(grid))))

    pace = 0.01 * lr * np.where((grid >= 180) & (grid < 260), rho, 1.0)  # d(y^-2)/dt
    inverse, lr_time = 1 + integral(pace), integral(lr)
    found: dict[tuple[str, int], list] = {}
    for clock in ("raw", "lr"):
        for back in (0, 1):
            found[clock, back] = []
            for seed in range(100):
                rng = np.random.default_rng(seed)
                m, t = ProgressMonitor(), 100.0
                for strategy in [old] * 4 + [new] * 4 + [old] * back:
                    for now in np.linspace(t, t + 20, 8, endpoint=False) + 1.25:
                        y = float(np.interp(now, grid, inverse)) ** -0.5
                        at = float(np.interp(now, grid, lr_time)) if clock == "lr" else now
                        m.observe(at, 2 + 5 * y + 0.01 * rng.normal(), 2.5, 2.5)
                    m.close_interval(strategy)
                    t += 20
                v = m.judge(old, new, 10.0, 4, back)
                found[clock, back].append((v.observed / rho, v.stderr / rho))
    (raw_x, raw_xe), (raw_b, _), *honest = (np.array(f).T for f in found.values())
    assert np.median(raw_x) < 0.92 and np.mean(abs(raw_x - 1) < 2 * raw_xe) < 0.7
    assert np.median(raw_b) > 1.05
    for ratio, error in honest:
        assert abs(np.median(ratio) - 1) < 0.06
        assert 0.8 <= np.mean(abs(ratio - 1) < 2 * error) <= 0.99


@pytest.mark.parametrize("start", [0.0, 20.0, 100.0])
def test_a_bracket_interpolates_the_old_rate_along_the_loss_power_law(start):
    """Noiseless readings of a Kaplan-shaped curve, ``L = 2 + 5 (1 + t/10)^-0.76`` (alpha_S of
    Kaplan et al. 2020), where the trial makes exactly the old strategy's progress: two
    intervals of 10 s on the old strategy, the trial, one back. Early on the rate falls
    several-fold across the bracket; a chord of the two sides' rates lies above the curve and
    read this equal trial x0.81 / x0.94 / x0.99 from t = 0 / 20 / 100 s. Along the power law
    it reads x0.95 / x0.99 / x1.00 (at t = 0 the rate halves within the first interval, whose
    slope a quadratic fit reads at its middle only approximately)."""
    old, new = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    m, t = ProgressMonitor(), start
    for strategy in (old, old, new, old):
        for now in np.linspace(t, t + 10, 8, endpoint=False) + 0.625:
            m.observe(float(now), 2 + 5 * (1 + now / 10) ** -0.76, 1.25, 1.25)
        m.close_interval(strategy)
        t += 10
    v = m.judge(old, new, 10.0, 1, 1)
    assert v.observed == pytest.approx(1.0, abs=0.06 if start == 0 else 0.02)


def test_the_session_reads_progress_against_time_weighted_by_the_lr_factor():
    """An executor whose LR schedule stands at half its peak: a loss falling 0.1 a second is
    0.2 per LR-weighted second, read at the readings' LR-weighted mid time, while the
    throughput side keeps the training seconds."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")

    class _Half(_Exec):
        def lr_factor(self):
            return 0.5

    s = _session([small, big], {small: 1.0, big: 1.0})
    s.executor = _Half(small)
    for i in range(8):
        s.observe(1.0, None, loss=10.0 - 0.1 * (i + 0.5))
    s.act(0, s.decide(0))
    rate = s.progress.rates[-1]
    assert rate.value == pytest.approx(0.2)
    assert rate.mid_time == pytest.approx(2.0)
    assert rate.seconds_per_sample == pytest.approx(1.0 / 16)


@pytest.mark.parametrize("seed", range(5))
def test_a_reading_no_bias_explains_teaches_nothing_about_the_bias(seed):
    """The old run's loss falls 0.001 a second read through 0.01 of noise, so its rate is
    known only roughly (even extrapolated to nearly 0); the new run's readings are exact.
    Where the new strategy makes 0.8x the old one's progress, every reading lies within its
    noise of what some bias predicts (throughput x (k phi + 16)/(k phi + 32), between 0.5 and
    1 here) and teaches about the bias. Where it makes 50x (no change of batch can), the
    comparison passes the consistency check on its own huge error (up to x10^12 +- 10^14),
    but its noise taken at the prediction puts it far outside: it counts no evidence and the
    posterior stays as it was (in the simulator such a reading, x359 +- 3628, moved the bias
    90x and held a batch 8x too small for the rest of the run)."""
    old, new = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    for speed, teaches in ((0.0008, True), (0.05, False)):
        rng = np.random.default_rng(seed)
        m, t, loss = ProgressMonitor(), 0.0, 5.0
        for strategy, rate, noise in ((old, 0.001, 0.01), (old, 0.001, 0.01), (new, speed, 0.0)):
            for _ in range(8):
                t += 2.5
                loss -= rate * 2.5
                m.observe(t - 1.25, loss + noise * rng.normal(), 2.5, 2.5)
            m.close_interval(strategy)
        v = m.judge(old, new, 10.0, 1)
        if not v.consistent:  # seed 0's fast run: refused by the consistency check already
            assert not teaches and seed == 0
            continue
        before = (m.bias, m.bias_sd)
        m.learn(v)
        assert (v.evidence is not None) == teaches
        assert ((m.bias, m.bias_sd) != before) == teaches


def test_a_bracketed_trial_that_read_slower_is_left_and_one_that_lost_is_remembered():
    """Batch 32 is truly worse than 16 here (phi = 4: the efficiency falls with the batch
    faster than the throughput per sample rises). The ranking keeps 16, but the probe's bias
    is unmeasured: CONA tries 32 as an experiment, goes back to 16 for one interval, reads
    the trial slower and stays on 16; the trial, confidently worse, is remembered (not tried
    again on the estimate alone) and the bias learned (below the prior's 10)."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}
    s = _session([small, big], secs, explore_after=1)

    def rate(strategy):  # loss per second at the true phi = 4
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (4 + 16) / (4 + b)

    path = _run_intervals(s, secs, rate, 4, 9)
    first = path.index(big)
    assert path[first + 1:] == [small] * (len(path) - first - 1)  # back, and stayed
    assert "bracketing the experiment" in s.decisions[first + 1].reason
    v = s.progress.verdicts[0]
    assert v.rollback and v.observed == pytest.approx(1.4 * 20 / 36, rel=0.05)
    assert big in s.tried and s.progress.bias < 10


@pytest.mark.parametrize("probe_phi, experiments", [(0.04, False), (4.0, True)])
def test_an_experiment_runs_only_where_the_plausible_biases_predict_different_outcomes(
        probe_phi, experiments):
    """The same noisy loss readings (sd 0.3 nats against ~0.3 nats of progress an interval),
    two probes. Reading phi = 4 against batches 16 and 32, biases 1/100 to 100 (the prior's
    two sd) predict progress ratios for 16 -> 32 from 0.50x to 0.96x the throughput's: a
    comparison within ~60% tells them apart and the experiment runs (its wait doubles).
    Reading phi = 0.04, every plausible k phi stays far below 16 and they all predict
    ~0.5-0.55x: no comparison these readings allow could say which, so none is run and the
    wait is not doubled."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 1.0 / 0.7}
    s = _session([small, big], secs, explore_after=3, probe_bias_prior=1.0)
    rng = np.random.default_rng(0)
    loss, path, waits = 10.0, [], []
    for _ in range(10):
        now = s.executor.strategy
        for _ in range(20):
            b = now.global_batch_size
            loss -= 1e-3 * (b / secs[now]) * (400 + 16) / (400 + b) * secs[now]
            s.observe(secs[now], _replicas_reading(probe_phi, b),
                      loss=loss + float(rng.normal(0, 0.3)))
        s.act(0, s.decide(0))
        path.append(s.executor.strategy)
        waits.append(s._explore_wait)
    if experiments:
        assert big in path and waits[-1] == 6
    else:
        assert path == [small] * 10 and waits == [3] * 10


@pytest.mark.parametrize("big_speedup, experiments", [(1.0, False), (1.4, True)])
def test_an_experiment_runs_only_where_knowing_the_bias_could_repay_what_it_costs(
        big_speedup, experiments):
    """The probe reads phi = 4 (true phi = 400) and ranks batch 16 first. Where batch 32 runs
    no more samples a second than batch 16 (``big_speedup`` 1.0), no bias at all makes it
    better (Pollux's efficiency only falls with the batch): knowing the bias is worth nothing
    and an experiment could only lose, so none runs and the wait is not doubled. Where it
    runs 1.4x the samples a second, the plausible high biases make 32 the better batch by up
    to ~40%: the experiment runs, pays and is kept."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    secs = {small: 1.0, big: 2.0 / big_speedup}
    s = _session([small, big], secs, explore_after=3)

    def rate(strategy):  # loss per second: throughput x Pollux's efficiency at phi = 400
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (400 + 16) / (400 + b)

    path = _run_intervals(s, secs, rate, 4, 9)
    if experiments:
        assert big in path and s._explore_wait == 6 and path[-1] == big
    else:
        assert path == [small] * 9 and s._explore_wait == 3


class _CostExec(_Exec):
    """Reports ``layout_s`` seconds for a layout switch (weights and optimizer state move) and
    none for a batch switch."""

    def __init__(self, start, layout_s=30.0):
        super().__init__(start)
        self.layout_s = layout_s

    def switch(self, target):
        old = self._strategy
        super().switch(target)
        return SwitchOutcome(True, self.layout_s if old.layout != target.layout else 0.0,
                             moved_tensors=old.layout != target.layout)


@pytest.mark.parametrize("layout_s, tried", [(None, "big"), (30.0, "big"), (0.0, "other")])
def test_an_experiment_makes_no_dear_or_unmeasured_layout_switch_to_test_a_batch(layout_s, tried):
    """The setting of the test above (the probe reads phi = 4, the truth is 400, batch 32 pays)
    with a second layout that runs batch 32 a little faster (1.42x batch 16's samples a second
    against the running layout's 1.4x; at the prior's bias batch 16 still ranks first). An
    experiment makes three switches (there, back, there again), so its trial is the one
    expected to lose least counting them, among those on the running layout or of a kind of
    switch already measured. A layout switch never made (None: its cost is a prior that a
    dear switch would miss by orders of magnitude) or measured at 30 s (an interval and a
    half: 4.5 intervals for a 1.4% faster layout) leaves the trial on the running layout;
    measured free, the faster layout is tried. Batch 32 pays and is kept either way."""
    small, big = P("dp4tp1pp1mb4gb16"), P("dp4tp1pp1mb8gb32")
    other = P("dp2tp2pp1mb8gb32")
    secs = {small: 1.0, big: 2.0 / 1.4, other: 2.0 / 1.42}
    s = _session([small, big, other], secs, explore_after=3)
    s.executor = _CostExec(small, 30.0 if layout_s is None else layout_s)
    if layout_s is not None:  # a layout switch measured before
        s.policy.costs.record(small, other, layout_s)

    def rate(strategy):
        b = strategy.global_batch_size
        return 1e-3 * (b / secs[strategy]) * (400 + 16) / (400 + b)

    path = _run_intervals(s, secs, rate, 4, 9)
    experiment = next(d for d in s.decisions if "trying" in d.reason)
    assert experiment.target == {"big": big, "other": other}[tried]
    assert path[-1].global_batch_size == 32


def test_intervals_too_short_for_a_rate_are_pooled_so_the_switch_is_still_judged():
    """Batch 64 -> 128 where each interval on 128 holds two loss readings (a short
    --cona-interval, or the simulator's first intervals at a large batch): two readings give
    no rate of their own. They used to be dropped, so the experiment ran its intervals and was
    never judged; now each joins the next interval on its strategy, and after two intervals
    the switch is judged on the four readings, finding the scripted ratio (0.8)."""
    old, new = P("dp4tp1pp1mb4gb64"), P("dp4tp1pp1mb4gb128")
    m = ProgressMonitor()
    for k in range(3):
        _feed(m, old, lambda t: 0.01, 100 * k, 100 * (k + 1), 1.0)
    assert _feed(m, new, lambda t: 0.008, 300, 350, 0.5, n=2) is None
    assert m.judge(old, new, probe_phi=50.0, intervals=1) is None
    assert _feed(m, new, lambda t: 0.008, 350, 400, 0.5, n=2) is not None
    v = m.judge(old, new, probe_phi=50.0, intervals=2)
    assert v is not None and v.observed == pytest.approx(0.8, rel=0.05)
    # readings carried from one strategy never join another's interval
    m2 = ProgressMonitor()
    _feed(m2, old, lambda t: 0.01, 0, 10, 1.0, n=2)
    assert _feed(m2, new, lambda t: 0.01, 10, 20, 1.0, n=2) is None
    assert len(_feed(m2, new, lambda t: 0.01, 20, 30, 1.0, n=2).readings[0]) == 4
