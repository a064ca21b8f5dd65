"""Did a batch switch pay? Loss progress per second measured before and after it, checked
against what the noise scale predicted -- and what the comparison says about the noise scale.

Progress per second is throughput x statistical efficiency (McCandlish et al. 2018; Pollux's
goodput). Across a change of global batch from ``B_a`` to ``B_b`` the throughput of both sides
is measured, so the observed ratio of progress rates measures the efficiency ratio
``e = (phi + B_a) / (phi + B_b)`` and hence the noise scale the training really has:
``phi = (B_a - e B_b) / (e - 1)``. The probe's noise scale can be biased: on OLMo, Merrill et al.
2025 found McCandlish's simple estimate 10-100x below the critical batch that branched training
measures. :class:`ProgressMonitor` keeps a posterior of the bias over every consistent
comparison (the session averages each candidate's efficiency over it), and says when a switch lost
progress beyond the readings' noise so that the session rolls it back and remembers it.

Assumptions (docs/cona.md): progress rates on one strategy change smoothly, so the rate the old
strategy would have had after the switch is read from its intervals around the switch: for an
experiment bracketed by intervals on the old strategy before and after it (the session's
``bracket``), interpolated between the two sides (along a power law of the loss), nothing
extrapolated; for an ordinary switch extrapolated from its last intervals' readings (one fit
over one interval or several, at least five readings, ln rate linear in the loss); loss
readings are unbiased with independent noise. Time is the training time weighted by the LR
schedule's factor (the session's): to first order the loss falls in proportion to the LR, so
that a decay across a comparison is not read as the strategy's doing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from predictors.spec import ParallelStrategy


@dataclass(frozen=True)
class Rate:
    """Loss decrease per second over one interval on one strategy (least squares over its
    readings), with its standard error, at the interval's mid time."""

    strategy: ParallelStrategy
    value: float
    stderr: float
    mid_time: float  # the readings' mean time, where the slope is taken
    mid_loss: float  # the fitted loss there: the level the rate belongs to
    seconds_per_sample: float  # measured: the throughput side of the ratio
    readings: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # (times, losses)


@dataclass(frozen=True)
class Verdict:
    """The comparison across one batch switch."""

    old: ParallelStrategy
    new: ParallelStrategy
    observed: float  # progress-rate ratio new / old (the old one extrapolated or bracketed)
    stderr: float
    efficiency_ratio: float  # observed / throughput ratio
    noise_scale: float  # the phi the comparison implies (nan: not identifiable)
    paid: bool
    rollback: bool
    confident: bool  # consistent with the efficiency model and precise enough to act on
    consistent: bool = True  # the efficiency ratio within what a change of batch can give
    # its testimony about the probe's bias (None: it has none), counted when it is learned
    evidence: Evidence | None = field(default=None, repr=False, compare=False)

    @property
    def held_up(self) -> bool:
        """Confidently no slower than the old strategy: what sets a floor, marks the old
        strategy measured-worse, and lifts a stale floor."""
        return self.confident and self.observed >= 1.0


NODE_BLOCK = 20  # grid points of ln k per node of the bias posterior
GRID_SD = 3.0  # the posterior grid's half-width in prior standard deviations (ln k)
OLD_HISTORY = 4  # the old strategy's intervals a comparison extrapolates from (pooled)


@dataclass(frozen=True)
class Evidence:
    """One comparison's testimony about the probe's bias: the observed progress-rate ratio
    new / old; what it would be for a bias ``k`` (the throughput ratio times the efficiency
    ratio at ``k`` times the probe's noise scale); its noise, split into the new rate's part
    (absolute, as a share of the old rate) and the old rates' part (relative)."""

    throughput: float
    batch_old: int
    batch_new: int
    probe_phi: float
    observed: float
    new_error: float
    old_relative_error: float


def readings(rates: list[Rate]) -> tuple[list[float], list[float]]:
    """The loss readings of consecutive intervals, pooled: (times, losses)."""
    return ([t for r in rates for t in r.readings[0]],
            [v for r in rates for v in r.readings[1]])


def fit_curve(times: list[float], losses: list[float], degree: int = 2
              ) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Least squares of the loss as a polynomial in time of ``degree`` (lower with few
    readings: a line below five) around the readings' mean time: coefficients
    ``(c0, c1, ...)`` of ``c0 + c1 t + c2 t^2 + ...`` (``t`` from the mean time), their
    covariance, and the mean time; None with fewer than three readings or no time span."""
    n = len(times)
    if n < 3:
        return None
    t0 = float(np.mean(times))
    t = np.asarray(times, dtype=float) - t0
    scale = float(np.abs(t).max())
    if not scale > 0:
        return None
    degree = min(degree, 1 if n < 5 else n - 3)
    x = np.vander(t / scale, degree + 1, increasing=True)  # columns 1, t, t^2 (scaled)
    coef, _, _, _ = np.linalg.lstsq(x, np.asarray(losses, dtype=float), rcond=None)
    resid = np.asarray(losses) - x @ coef
    cov = np.linalg.pinv(x.T @ x) * float(resid @ resid) / (n - degree - 1)
    unscale = scale ** -np.arange(degree + 1)
    return coef * unscale, cov * np.outer(unscale, unscale), t0


def fit_rate(times: list[float], losses: list[float]) -> tuple[float, float, float, float]:
    """The loss decrease per second at the readings' mean time, its standard error, that time
    and the fitted loss there: :func:`fit_curve`'s slope, so that a curve's bend within an
    interval is not mistaken for noise, and its level, the loss the slope belongs to (on a
    bending curve the readings' mean loss lies above it, the more so the longer the run: a
    rate pooled over four intervals filed under their mean loss was compared with the old
    strategy's rate at too high a loss, i.e. too fast a one); (nan, inf, nan, nan) with
    fewer than three readings."""
    fit = fit_curve(times, losses)
    if fit is None:
        return math.nan, math.inf, math.nan, math.nan
    coef, cov, t0 = fit
    return float(-coef[1]), float(math.sqrt(max(cov[1, 1], 0.0))), t0, float(coef[0])


def rate_at_loss(times: list[float], losses: list[float], loss: float
                 ) -> tuple[float, float] | None:
    """The loss decrease per second one run of readings would have at ``loss`` (beyond its
    end), and its relative error: ``ln r`` linear in the loss from the run's middle, with the
    slope the run's curve has there, ``d ln r / dL = 2 c2 / r^2`` (clipped at 0: the rate
    falls as the loss does), the curve a cubic in time (a quadratic's bend over a run of
    several intervals absorbs the bend's own change, and is biased). One least squares over
    the whole run: separate intervals' rates each carry their own readings' noise, and early
    in training (short intervals) that noise is comparable to an interval's progress. None
    without a falling fit."""
    fit = fit_curve(times, losses, degree=3)
    if fit is None or fit[0].size < 3:
        return None
    coef, cov, _ = fit

    def ln_rate(c: np.ndarray) -> float:
        r = -c[1]
        return math.log(r) + max(0.0, 2.0 * c[2] / (r * r)) * (loss - c[0])

    if not -coef[1] > 0:
        return None
    value = ln_rate(coef)
    if not abs(value) < 700:  # a bend fitted to noise: no extrapolation to trust
        return None
    step = 1e-6 * np.maximum(np.abs(coef), 1e-12)
    grad = np.array([(ln_rate(coef + np.eye(coef.size)[k] * step[k]) - value) / step[k]
                     for k in range(coef.size)])
    return math.exp(value), math.sqrt(max(float(grad @ cov @ grad), 0.0))


# A bracket interpolates the old strategy's rate along a power law of the loss: the loss falls
# as a power of the steps (Kaplan et al. 2020, arXiv 2001.08361, Eq 1.6 / Table 5:
# L(S) ~ S^-alpha_S, alpha_S = 0.76), so its rate is the power 1 + 1/alpha_S of the excess loss
# and the rate to this power is linear in the loss. A chord of the rates themselves lies above
# that curve: on it an equal trial read x0.55-0.94 (docs/cona.md, the twenty-sixth session).
RATE_POWER = 0.76 / 1.76


def _between(before: Rate, after: Rate, w: float) -> tuple[float, float]:
    """The rate ``w`` of the way (in the loss) from ``before`` to ``after``, ``r^q`` linear
    in the loss (``q`` = :data:`RATE_POWER`; linear in the rate itself where a side is not
    positive), and its standard error (absolute). Callers take it relative to one rate for both
    sides, never to each side's own: a side read high by chance would otherwise state its own
    error small and make a comparison on noisy readings look precise."""
    if not (before.value > 0 and after.value > 0):
        return ((1 - w) * before.value + w * after.value,
                math.hypot((1 - w) * before.stderr, w * after.stderr))
    q = RATE_POWER
    rate = ((1 - w) * before.value ** q + w * after.value ** q) ** (1 / q)
    # d rate / d side = its weight x (rate / side)^(1 - q)
    return rate, math.hypot((1 - w) * (rate / before.value) ** (1 - q) * before.stderr,
                            w * (rate / after.value) ** (1 - q) * after.stderr)


def implied_noise_scale(efficiency_ratio: float, batch_old: float, batch_new: float) -> float:
    """``phi`` with ``(phi + B_old) / (phi + B_new) = e``; nan where ``e`` is outside the open
    range the model allows (between 1 and ``B_old / B_new``)."""
    e, lo, hi = efficiency_ratio, min(1.0, batch_old / batch_new), max(1.0, batch_old / batch_new)
    if not lo < e < hi:
        return math.nan
    return (batch_old - e * batch_new) / (e - 1.0)


@dataclass
class ProgressMonitor:
    """Per-interval progress rates; a verdict on each batch switch; the probe's bias."""

    z: float = 2.0  # standard errors a rollback needs (and a calibration must be within)
    max_relative_error: float = 0.25  # comparisons noisier than this are not acted on
    # prior on the probe's bias k (phi_true = k phi_probe): log-normal around ``prior_bias``
    # with ``prior_sd`` of ln k. Published ratios of the critical batch to the simple noise
    # scale span ~1 (McCandlish et al. 2018, arXiv 1812.06162: B_simple tracks B_crit) to
    # 10-100 (Merrill et al. 2025, arXiv 2505.23971, OLMo-1B); the prior is centred on their
    # geometric middle, so that both ends lie one standard deviation away
    prior_bias: float = 10.0
    prior_sd: float = math.log(10.0)
    calibrated_sd: float = math.log(2.0) / 2  # the bias counts as measured below this sd
    _times: list[float] = field(default_factory=list)
    _losses: list[float] = field(default_factory=list)
    _seconds: float = 0.0
    _samples: float = 0.0
    # an interval with too few readings for a rate of its own (a short --cona-interval, or a
    # large batch early in training): its strategy, times, losses, seconds and samples
    _carry: tuple[ParallelStrategy, list[float], list[float], float, float] | None = None
    rates: list[Rate] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    _evidence: list[Evidence] = field(default_factory=list)
    _posterior: tuple[float, float] = (0.0, 0.0)  # mean, sd of ln k (set from the prior)
    _nodes: tuple[tuple[float, float], ...] = ()  # the posterior of k as (k, weight) nodes

    def __post_init__(self) -> None:
        self._update_posterior()

    def observe(self, elapsed: float, loss: float, seconds: float, samples: float) -> None:
        """A loss reading at ``elapsed`` training seconds (weighted by the LR schedule's
        factor: the session's); ``seconds`` and ``samples`` the training time (unweighted: the
        throughput side) and samples the reading stands for."""
        if math.isfinite(loss):
            self._times.append(elapsed)
            self._losses.append(loss)
        self._seconds += seconds
        self._samples += samples

    @property
    def calibrated(self) -> bool:
        """Whether measured progress has pinned the probe's bias down (posterior sd)."""
        return self.bias_sd < self.calibrated_sd

    @property
    def bias(self) -> float:
        """The factor the probe's noise scale is multiplied by: the posterior mean of ln k
        given every comparison so far (``prior_bias`` before any)."""
        return math.exp(self._posterior[0])

    @property
    def bias_sd(self) -> float:
        """The posterior standard deviation of ln k: how well measured progress knows the
        bias (the prior's ln 10 before any comparison)."""
        return self._posterior[1]

    @property
    def bias_nodes(self) -> tuple[tuple[float, float], ...]:
        """The posterior of the bias as ``(k, weight)`` nodes (weights sum to 1): what the
        session averages a candidate's efficiency over. Ranking with one point (the mean of
        ln k) is fragile where the comparisons only bound k from one side: their likelihood is
        flat beyond the batches compared, and the mean then jumps with each noisy reading."""
        return self._nodes

    def _update_posterior(self) -> None:
        """ln k on a grid: the log-normal prior times each comparison's Gaussian likelihood of
        its observed progress ratio under ``throughput x (k phi + B_old) / (k phi + B_new)``."""
        # the grid spans the prior's +-GRID_SD standard deviations around its centre, wherever
        # the centre is: a fixed range would cut off the prior of a job that set its own
        centre = math.log(self.prior_bias)
        grid = np.linspace(centre - GRID_SD * self.prior_sd, centre + GRID_SD * self.prior_sd,
                           601)
        log_post = -0.5 * ((grid - centre) / self.prior_sd) ** 2
        k = np.exp(grid)
        for e in self._evidence:
            predicted = e.throughput * (k * e.probe_phi + e.batch_old) / (
                k * e.probe_phi + e.batch_new)
            # the new rate's noise is the loss readings' (absolute); the old rates' is relative
            # to the ratio, so it is taken at the predicted ratio, not at the observed one
            # (hypot: an old rate extrapolated to nearly 0 gives errors whose squares overflow;
            # such a comparison is only weightless, never a crash)
            sigma = np.hypot(e.new_error, predicted * e.old_relative_error)
            log_post -= 0.5 * ((e.observed - predicted) / sigma) ** 2 + np.log(sigma)
        w = np.exp(log_post - log_post.max())
        w /= w.sum()
        mean = float((w * grid).sum())
        self._posterior = (mean, float(math.sqrt(max((w * (grid - mean) ** 2).sum(), 0.0))))
        # condensed to one node per block of the grid (a factor ~1.4 in k), negligible ones
        # dropped: a few dozen efficiency evaluations per candidate, not 601
        blocks = grid.size // NODE_BLOCK
        bw = w[:blocks * NODE_BLOCK].reshape(blocks, NODE_BLOCK)
        bg = grid[:blocks * NODE_BLOCK].reshape(blocks, NODE_BLOCK)
        mass = bw.sum(axis=1)
        keep = mass > 1e-4
        centre = (bw * bg).sum(axis=1)[keep] / mass[keep]
        mass = mass[keep] / mass[keep].sum()
        self._nodes = tuple((float(math.exp(c)), float(m)) for c, m in zip(centre, mass,
                                                                            strict=True))

    def expected_error(self, intervals: int, back: int = 0) -> float:
        """The relative error a comparison judged after ``intervals`` intervals on a new
        strategy would have (:meth:`judge`), forecast from the current run (inf before two
        rates): the current run's own last ``intervals`` pooled stand for the new side; the
        old side is, with ``back`` intervals back on the old strategy after the trial (a
        bracketed experiment), the interpolation (:func:`_between`) between the run's last two
        intervals and its last ``back`` ones at the weight the trial's middle would get, its
        error relative to the run's pace; without, the run's extrapolation to the loss the new
        run's middle would reach at the current pace."""
        run = self._run_before(len(self.rates), self.rates[-1].strategy) if self.rates else []
        if len(run) < 2:
            return math.inf
        pooled = self._pooled(run[-intervals:])
        if pooled is None or not pooled.value > 0:
            return math.inf
        new_rel = pooled.stderr / pooled.value
        if back:
            before, after, pace = self._pooled(run[-2:]), self._pooled(run[-back:]), \
                self._pooled(run)
            if before is None or after is None or pace is None or not pace.value > 0:
                return math.inf
            w = (1.0 + intervals / 2) / (1.0 + intervals + back / 2)  # the trial's middle
            # relative to the run's pace, not to the sides' own rates: the comparison's old
            # side is read from future intervals, whose rate the whole run forecasts best, and
            # one interval read high by chance must not promise a precise comparison
            return math.hypot(_between(before, after, w)[1] / pace.value, new_rel)
        drop = (run[0].mid_loss - run[-1].mid_loss) / (len(run) - 1)
        fit = rate_at_loss(*readings(run), run[-1].mid_loss - drop * (intervals + 1) / 2)
        if fit is None:
            return math.inf
        return math.hypot(fit[1], new_rel)

    def close_interval(self, strategy: ParallelStrategy) -> Rate | None:
        """The interval's rate on ``strategy``; starts the next interval. An interval with
        too few readings for a rate (None) is kept and joins the next one if that runs on the
        same strategy: discarded, a batch whose intervals hold two readings each could never
        be judged."""
        if self._carry is not None:
            carried, times, losses, seconds, samples = self._carry
            self._carry = None
            if carried == strategy:
                self._times, self._losses = times + self._times, losses + self._losses
                self._seconds += seconds
                self._samples += samples
        value, stderr, mid_time, level = fit_rate(self._times, self._losses)
        rate = None
        if math.isfinite(value) and self._samples > 0:
            rate = Rate(strategy, value, stderr, mid_time, level, self._seconds / self._samples,
                        (tuple(self._times), tuple(self._losses)))
            self.rates.append(rate)
        elif self._times:
            self._carry = (strategy, self._times, self._losses, self._seconds, self._samples)
        self._times, self._losses, self._seconds, self._samples = [], [], 0.0, 0.0
        return rate

    def judge(self, old: ParallelStrategy, new: ParallelStrategy, probe_phi: float,
              intervals: int = 1, back: int = 0) -> Verdict | None:
        """After ``intervals`` intervals on ``new`` (a batch switch from ``old``): did it pay?
        Their readings are pooled into one rate. With ``back`` intervals on ``old`` again
        after them (a bracketed experiment), the old strategy's rate at the new one's loss is
        interpolated between its last intervals before the switch and those after; without,
        it is extrapolated from the old run before the switch (early in training the rate
        falls fast, and a comparison without its trend would blame the switch). The evidence
        about the probe's bias is counted once per switch: call with growing ``intervals``
        and only the final verdict's counts (``learn``)."""
        # the rates since the switch: fewer than its intervals where short ones were pooled
        # into the next (``close_interval``)
        backs = self._run_before(len(self.rates), old, limit=back) if back else []
        if back and not backs:
            return None
        end = len(self.rates) - len(backs)
        news = self._run_before(end, new, limit=intervals)
        olds = self._run_before(end - len(news), old)
        # one interval on the old strategy is enough where its readings are (rate_at_loss's
        # cubic needs five; it says None with fewer): a move made after one interval is
        # judged too, not taken on the ranking's word
        if not news or not olds:
            return None
        b = news[0] if len(news) == 1 else self._pooled(news)
        a1 = olds[-1]
        if b is None or not b.value > 0 or not olds[0].mid_loss > b.mid_loss:
            return None
        # the old strategy's rate at the loss level the new one reached (the rate falls as the
        # loss does). Comparing at equal loss, not equal time: a faster strategy reaches lower
        # losses sooner, and a time extrapolation would charge it the old one's slowdown there.
        fit = (self._interpolated(olds, backs, b.mid_loss) if backs
               else rate_at_loss(*readings(olds), b.mid_loss))
        if fit is None:
            return None
        expected, old_rel = fit
        observed = b.value / expected
        rel = math.hypot(old_rel, b.stderr / b.value)
        stderr = observed * rel
        throughput = a1.seconds_per_sample / b.seconds_per_sample
        efficiency = observed / throughput
        # the efficiency ratio a change of batch can give lies between 1 and B_old / B_new;
        # a reading outside (beyond its noise) says the comparison itself failed: no verdict
        lo, hi = sorted((1.0, old.global_batch_size / new.global_batch_size))
        slack = self.z * efficiency * rel
        consistent = lo - slack <= efficiency <= hi + slack
        phi = implied_noise_scale(efficiency, old.global_batch_size, new.global_batch_size)
        confident = consistent and rel <= self.max_relative_error
        paid = observed >= 1.0 - self.z * stderr
        # a noiseless comparison (a test's) still gets a finite likelihood
        new_error = max(b.stderr / expected, 1e-3 * observed)
        # testimony about the bias only where some bias explains the reading within z of its
        # noise taken at the prediction, as the likelihood takes it: an old rate extrapolated
        # to nearly 0 read x359 +- 3628, consistent by its own huge error yet far beyond
        # z of every bias's prediction, and how far out it lay still moved the bias 90x
        nearest = min(max(observed, throughput * lo), throughput * hi)
        explained = abs(observed - nearest) <= self.z * math.hypot(new_error, nearest * old_rel)
        evidence = Evidence(
            throughput, old.global_batch_size, new.global_batch_size, probe_phi, observed,
            new_error, old_relative_error=old_rel) \
            if consistent and explained and probe_phi > 0 else None
        return Verdict(old, new, observed, stderr, efficiency, phi, paid,
                       rollback=confident and not paid, confident=confident,
                       consistent=consistent, evidence=evidence)

    def _interpolated(self, olds: list[Rate], backs: list[Rate], loss: float
                      ) -> tuple[float, float] | None:
        """The old strategy's rate at ``loss`` between its side before a trial (its last two
        intervals pooled) and after it (``backs`` pooled), along a power law of the loss
        (:func:`_between`), and its relative error; None unless it is positive and the loss
        fell from one side to the other. Interpolated, not extrapolated: an extrapolated old
        side is biased where the curve bends (experiments read 16-19% too pessimistic that way,
        docs/cona.md)."""
        before = olds[-1] if len(olds) == 1 else self._pooled(olds[-2:])
        after = backs[0] if len(backs) == 1 else self._pooled(backs)
        if before is None or after is None or not before.mid_loss > after.mid_loss:
            return None
        w = (before.mid_loss - loss) / (before.mid_loss - after.mid_loss)
        rate, error = _between(before, after, min(1.0, max(0.0, w)))
        return (rate, error / rate) if rate > 0 else None

    def learn(self, verdict: Verdict) -> None:
        """Keep ``verdict`` (a :meth:`judge` result) and count its evidence about the probe's
        bias."""
        self.verdicts.append(verdict)
        if verdict.evidence is not None:
            self._evidence.append(verdict.evidence)
            self._update_posterior()

    def _run_before(self, end: int, strategy: ParallelStrategy, limit: int = OLD_HISTORY
                    ) -> list[Rate]:
        """The last ``limit`` rates before index ``end``, all on ``strategy`` and consecutive
        (the run a switch left; or, ending at the last rate, the run since a switch)."""
        run: list[Rate] = []
        for r in reversed(self.rates[max(0, end - limit):end]):
            if r.strategy != strategy:
                break
            run.append(r)
        return run[::-1]

    @staticmethod
    def _pooled(rates: list[Rate]) -> Rate | None:
        times, losses = readings(rates)
        value, stderr, mid_time, level = fit_rate(times, losses)
        if not math.isfinite(value):
            return None
        weight = [len(r.readings[0]) for r in rates]
        per = sum(r.seconds_per_sample * w for r, w in zip(rates, weight, strict=True))
        return Rate(rates[0].strategy, value, stderr, mid_time, level, per / sum(weight),
                    (tuple(times), tuple(losses)))
