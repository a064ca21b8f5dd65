"""The CONA session: the one observe -> rank -> decide -> act loop.

Every iteration the training loop hands :meth:`ConaSession.after_step` the iteration's time and
gradient statistics; every ``interval`` iterations the session ranks all candidates by goodput
(measured time for the running strategy, calibrated predictions for the others; statistical
efficiency from the gradient noise scale), asks the policy, and acts through an
:class:`Executor`:

* :class:`megatron_cona.runtime.executor.RuntimeExecutor` -- ``pretrain_gpt``'s runtime:
  switches layouts and batches in memory (transactional reshard);
* :class:`megatron_cona.hook.MegatronLMExecutor` -- inside Megatron-LM's own ``train()``: global
  batch changes in place; layout changes raise :class:`SwitchUnsupported` with the reason;
* :class:`megatron_cona.lawsim.chains.SimExecutor` -- the law-based simulation's cluster
  (simulated progress and clock).

The session holds no engine objects; the executor reports the measured cost of each switch back,
and the learning rate follows the global batch through the one LR rule
(:func:`megatron_cona.lr_scaling.lr_scale`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_cona.arguments import STARTS, ConaSettings
from megatron_cona.candidates import PredictorMemory, enumerate_candidates
from megatron_cona.executor import Executor, SwitchOutcome, SwitchUnsupported
from megatron_cona.gns import GradientNoiseScale, GradStats, measures_noise
from megatron_cona.goodput import (
    AnalyticalThroughput,
    CalibratedThroughput,
    GoodputEstimate,
    PredictorThroughput,
    ThroughputModel,
    estimate,
    rank,
)
from megatron_cona.lr_scaling import BatchLR
from megatron_cona.policy import Decision, DecisionLog, PolicyConfig, SwitchCostModel, SwitchPolicy
from megatron_cona.progress import ProgressMonitor, Verdict
from predictors.spec import ParallelStrategy, TransformerSpec
from predictors.spec.engines import from_megatron_args
from predictors.spec.precision import get_precision

log = logging.getLogger("megatron_cona.session")


# the biases an experiment must be able to tell apart: the posterior's mean +- this many sd
# (at the prior, sd ln 10 around 10: 1/10 to 1,000, Merrill et al.'s 10-100x gap inside)
RESOLVE_SD = 2.0


@dataclass
class SessionConfig:
    interval: int = 50
    base_batch: int = 8  # the global batch the base learning rate was tuned for
    lr_rule: str = "sqrt"
    warmup_iterations: int = 0  # no ranking before this many iterations (noisy start)
    lr_table: dict[int, float] | None = None  # per-batch LR (rule 'table'), else lr_rule
    noise_z: float = 1.0  # standard errors of the noise scale a switch must survive
    # a layout blind to the noise scale (DP = 1, one micro-batch) is entered only once the
    # estimate is within this factor (1 + tolerance) either way, and left after
    # ``blind_decisions`` rankings so that the estimate is measured again
    converged_tolerance: float = 1.0
    blind_decisions: int = 8
    # check every batch switch against the measured loss progress (roll back what did not pay,
    # correct the probe's noise scale by what the progress implies): megatron_cona.progress
    confirm: bool = True
    # while measured progress has not pinned down the probe's bias, after this many rankings on
    # one global batch CONA tries the best strategy at twice that batch, held until its
    # comparison is confident or ``judge_intervals`` passed (the probe's noise scale may sit
    # 10-100x below the critical batch: Merrill et al. 2025), the wait doubling after every
    # experiment; 0: never
    explore_after: int = 4
    judge_intervals: int = 4  # an experiment's trial runs at most this many intervals
    # intervals with a rate of their own (at most judge_intervals in all) an experiment then
    # runs back on the strategy it left, so that the old rate at the trial's loss is
    # interpolated between both sides instead of extrapolated (an extrapolation is biased where
    # the rate is not a function of the loss alone: an LR schedule); a trial measured faster
    # is switched back to.
    # 0: judged on the trial's own intervals, the old side extrapolated
    bracket: int = 1
    # where the run starts (:meth:`ConaSession.begin`): 'smallest' -- the smallest candidate
    # global batch on the configured layout and micro-batch, since the critical batch is at its
    # smallest when training starts (McCandlish et al. 2018 Sec 3.3; Kaplan et al. 2020 Eq 5.3)
    # and CONA grows it from the probe's first readings, as Pollux grows from its initial batch;
    # 'configured' -- the job's own global batch
    start: str = "smallest"
    # the centre of the prior on the probe's bias (critical batch / probe's noise scale):
    # :attr:`ProgressMonitor.prior_bias`, the published ratios' geometric middle; a job whose
    # ratio was measured (branched runs) sets its own
    probe_bias_prior: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.bracket, bool) or not (
                isinstance(self.bracket, int)
                and 0 <= self.bracket <= max(self.judge_intervals, 1)):
            raise ValueError(f"bracket={self.bracket!r} must be a whole number of intervals "
                             f"from 0 to judge_intervals ({self.judge_intervals})")
        if not (self.probe_bias_prior > 0 and math.isfinite(self.probe_bias_prior)):
            raise ValueError(f"probe_bias_prior={self.probe_bias_prior!r} must be a positive "
                             "finite ratio")
        if self.start not in STARTS:
            raise ValueError(f"start={self.start!r} is unknown; choose one of "
                             f"{', '.join(STARTS)}")

    def batch_lr(self) -> BatchLR:
        """The LR rule as multipliers of the base batch's LR."""
        if self.lr_table:
            return BatchLR.from_table(self.lr_table, self.base_batch)
        return BatchLR(1.0, self.base_batch, self.lr_rule)


@dataclass
class Unsupported:
    iteration: int
    target: ParallelStrategy
    reason: str


@dataclass
class SwitchRecord:
    iteration: int
    old: ParallelStrategy
    new: ParallelStrategy
    outcome: SwitchOutcome


class ConaSession:
    def __init__(
        self,
        candidates: Sequence[ParallelStrategy],
        times: CalibratedThroughput,
        policy: SwitchPolicy,
        gns: GradientNoiseScale,
        config: SessionConfig,
        executor: Executor,
        log: DecisionLog | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("candidates is empty")
        self.candidates = list(candidates)
        self.times = times
        self.policy = policy
        self.gns = gns
        self.config = config
        self.executor = executor
        self.log = log or DecisionLog(None)
        self.decisions: list[Decision] = []
        self.switches: list[SwitchRecord] = []
        self.unsupported: list[Unsupported] = []
        self._interval_time = 0.0
        self._lr = config.batch_lr()
        self._blind_rankings = 0  # rankings made in a row on a layout blind to the noise scale
        self.progress = ProgressMonitor(prior_bias=config.probe_bias_prior)
        self._elapsed = 0.0  # training seconds observed
        self._lr_elapsed = 0.0  # the same, each weighted by the LR schedule's factor
        # the batch switch being judged: (old, new, experiment, intervals on new so far)
        self._judging: tuple[ParallelStrategy, ParallelStrategy, bool, int] | None = None
        # an experiment back on the strategy it left: (old, trial, intervals the trial ran,
        # intervals back with a rate of their own so far, intervals back in all, the trial's
        # own verdict)
        self._bracketing: tuple[ParallelStrategy, ParallelStrategy, int, int, int,
                                Verdict | None] | None = None
        self._judged_move = False  # the next switch is a bracket's: already judged
        self.tried: dict[ParallelStrategy, float] = {}  # left as worse -> noise scale then
        # (strategy, noise scale, training seconds then): a larger batch was measured to pay
        # over this one
        self._floor: tuple[ParallelStrategy, float, float] | None = None
        self._challenging = False  # a move below a stale floor is being judged
        self._same_batch = 0  # rankings in a row on the running global batch
        self._explore_wait = config.explore_after  # doubles after every experiment
        self._experimenting = False  # the last decision is an experiment

    # ----------------------------------------------------------------------------- observe
    def observe(self, seconds: float, stats: GradStats | None = None,
                iterations: float = 1.0, loss: float | None = None) -> None:
        """One finished iteration of the running strategy that took ``seconds``; with
        ``iterations`` > 1 the reading stands for that many such iterations (a loop that reads
        the probe on every k-th iteration only). ``loss``: the iteration's training loss (the
        mean over the iterations it stands for)."""
        strategy = self.executor.strategy
        self.times.record(strategy, seconds)
        span = seconds * iterations
        self._interval_time += span
        # progress is read against training time weighted by the LR schedule's factor: to
        # first order the loss falls in proportion to the LR, and a decay between two sides
        # of a comparison would otherwise read as a worse strategy
        lr_span = span * self.executor.lr_factor()
        if loss is not None:
            self.progress.observe(self._lr_elapsed + lr_span / 2, loss, span,
                                  iterations * strategy.global_batch_size)
        self._elapsed += span
        self._lr_elapsed += lr_span
        sample = stats.sample() if stats is not None else None
        if sample is not None:
            self.gns.observe(sample)

    @property
    def noise_scale(self) -> float:
        """The probe's noise scale corrected by the bias measured progress implies."""
        return self.gns.noise_scale * self.progress.bias

    def due(self, iteration: int) -> bool:
        return iteration >= self.config.warmup_iterations and iteration % self.config.interval == 0

    # ------------------------------------------------------------------------ rank, decide
    def current_estimate(self, strategy: ParallelStrategy, probe_phi: float | None = None,
                         uncertainty: float = 0.0) -> GoodputEstimate:
        """``strategy``'s goodput with its efficiency averaged over the probe's bias as
        measured progress knows it (:attr:`ProgressMonitor.bias_nodes`), at the probe's noise
        scale or at ``probe_phi`` (a value within its uncertainty)."""
        probe_phi = self.gns.noise_scale if probe_phi is None else probe_phi
        return estimate(strategy, self.times.iteration_time(strategy), probe_phi,
                        self.config.base_batch, self.times.source(strategy), uncertainty,
                        self._efficiency_lr_scale(strategy, self.noise_scale),
                        self.progress.bias_nodes)

    def _efficiency_lr_scale(self, strategy: ParallelStrategy, phi: float) -> float | None:
        # adascale IS the gain Pollux's efficiency assumes; every other rule caps the gain
        if self.config.lr_rule == "adascale" and not self.config.lr_table:
            return None
        return self._lr.scale(strategy.global_batch_size, phi)

    def robust_gain(self, current: ParallelStrategy, best: ParallelStrategy) -> float:
        """The best candidate's smallest gain over the running one with the noise scale
        anywhere within ``noise_z`` standard errors of its estimate (measured uncertainty)."""
        gains = []
        phis = (self.gns.noise_scale, *self.gns.noise_scale_range(self.config.noise_z))
        for phi in phis:
            if math.isnan(phi):
                continue
            phi = min(phi, 1e12)
            gains.append(self.current_estimate(best, phi).goodput
                         / self.current_estimate(current, phi).goodput - 1.0)
        return min(gains) if gains else math.nan

    def _pool(self, strategy: ParallelStrategy) -> tuple[list[ParallelStrategy], str | None]:
        """The candidates this ranking may choose from, and why the running strategy must be
        left (None: it need not). Blind layouts (:func:`~megatron_cona.gns.measures_noise`)
        are open only while the noise scale has converged; after ``blind_decisions`` rankings on
        one, the session leaves it to measure again."""
        blind = not measures_noise(strategy.dp, strategy.num_microbatches)
        self._blind_rankings = self._blind_rankings + 1 if blind else 0
        stale = self._blind_rankings > self.config.blind_decisions
        phi = self.noise_scale
        # only what the executor can switch to (the rest: _recommend); a strategy rolled back
        # is not tried again until the noise scale moved 2x since
        candidates = [s for s in self._reachable(strategy) if s == strategy
                      or s not in self.tried or not 0.5 < phi / self.tried[s] < 2.0]
        # nor down to the batch of one a larger batch was measured to beat, on a strategy no
        # faster per sample, while the noise scale has not fallen 2x: the per-sample
        # efficiency a doubling to B keeps, (phi + B/2) / (phi + B), is larger at smaller B,
        # and so is the samples per second a doubling adds, so a doubling that paid at one
        # batch pays more at every smaller one (the noise scale only grows as the loss falls);
        # once the training time since the verdict doubled, a move below is an experiment
        if self._floor is not None and phi > self._floor[1] / 2 and not self._floor_stale():
            worse = self._floor[0]
            pace = worse.global_batch_size / self.times.iteration_time(worse)
            candidates = [s for s in candidates if s == strategy
                          or s.global_batch_size > worse.global_batch_size
                          or s.global_batch_size / self.times.iteration_time(s) > pace]
        if self.gns.converged(self.config.converged_tolerance) and not stale:
            return candidates, None
        pool = [s for s in candidates if measures_noise(s.dp, s.num_microbatches)]
        if stale and pool:
            return pool, (f"noise scale not measured for {self._blind_rankings - 1} rankings "
                          "on a blind layout (DP = 1, one micro-batch): leaving to re-measure")
        return pool + ([strategy] if blind else []), None

    def _reachable(self, strategy: ParallelStrategy) -> list[ParallelStrategy]:
        """The candidates the executor can switch to from ``strategy`` (and it)."""
        return [s for s in self.candidates
                if s == strategy or self.executor.why_not(s) is None]

    def _rank(self, pool: Sequence[ParallelStrategy]) -> list[GoodputEstimate]:
        """``pool`` by goodput, best first, at the probe's noise scale and the bias as measured
        progress knows it, the LR rule's gain at the corrected noise scale."""
        phi = self.noise_scale
        return rank(pool, self.times, self.gns.noise_scale, self.config.base_batch,
                    lambda s: self._efficiency_lr_scale(s, phi), self.progress.bias_nodes)

    def _recommend(self, iteration: int, strategy: ParallelStrategy,
                   reachable: GoodputEstimate) -> None:
        """Where a candidate the executor cannot switch to (the Megatron-LM hook: another
        layout or micro-batch) beats ``reachable``, the best it can reach, by the policy's
        ``min_gain`` and its own prediction error, it is recorded as a recommendation
        (:attr:`unsupported`, with the executor's reason) when it changes, and the run goes
        on deciding among what the executor can do."""
        others = [s for s in self.candidates if s != strategy and s not in self.tried
                  and self.executor.why_not(s) is not None]
        if not others:
            return
        best = self._rank(others)[0]
        if best.goodput <= reachable.goodput * (1 + self.policy.config.min_gain
                                                 + best.uncertainty):
            return
        if self.unsupported and self.unsupported[-1].target == best.strategy:
            return
        why = self.executor.why_not(best.strategy) or ""
        self.unsupported.append(Unsupported(iteration, best.strategy, why))
        log.warning("iteration %d: CONA recommends %s (goodput x%.3f of the best this loop can "
                    "switch to, %s) but cannot switch here: %s", iteration,
                    best.strategy.name, best.goodput / reachable.goodput,
                    reachable.strategy.name, why)

    def _check_last_switch(self, strategy: ParallelStrategy
                           ) -> tuple[Verdict | None, bool, ParallelStrategy | None]:
        """Close the interval's progress rate; judge the last batch switch on the intervals
        since it (it updates the noise-scale bias); a verdict to roll back is remembered. An
        experiment is held (True) until its verdict is confident or ``judge_intervals`` passed,
        then bracketed: ``bracket`` intervals back on the strategy it left (the third value:
        where to go now), judged on both sides, and a trial measured faster is gone back to; an
        ordinary switch is judged on its first interval."""
        rate = self.progress.close_interval(strategy)
        if self._judging is None and self._bracketing is None:
            self._challenging = False  # a move below the floor was not made: nothing to judge
        if not self.config.confirm:
            return None, False, None
        phi, back, bracketed = self.gns.noise_scale, 0, False
        if self._bracketing is not None:
            old, new, seen, back, steps, trial = self._bracketing
            steps += 1
            self._bracketing = None
            if strategy != old:  # the way back could not be taken: the trial ran on
                seen, back = seen + steps, 0
                verdict = self.progress.judge(old, new, phi, seen)
            else:
                back += rate is not None  # an interval too short for a rate joins the next
                if back < self.config.bracket and steps < max(self.config.judge_intervals, 1):
                    self._bracketing = (old, new, seen, back, steps, trial)
                    return None, True, None
                bracketed = True
                # no rate back (its intervals too short) or no interpolation (the readings
                # refuse one): the trial's own verdict stands, not nothing
                verdict = (self.progress.judge(old, new, phi, seen, back) if back else None) \
                    or trial
        elif self._judging is not None:
            old, new, experiment, seen = self._judging
            seen += 1
            self._judging = None
            verdict = self.progress.judge(old, new, phi, seen)
            if experiment and seen < self.config.judge_intervals and (
                    verdict is None or not verdict.confident):
                self._judging = (old, new, experiment, seen)
                return None, True, None
            if experiment and self.config.bracket and not self._challenging:
                self._bracketing = (old, new, seen, 0, 0, verdict)
                return None, True, old
        else:
            return None, False, None
        challenged, self._challenging = self._challenging, False
        if verdict is not None:
            self.progress.learn(verdict)
            if challenged and not verdict.held_up:
                # a stale floor is lifted only by a move below it that measurably paid; one
                # that did not (lost, or could not tell) goes back
                verdict = replace(verdict, rollback=True)
        if challenged:  # lifted, or binding again from now
            self._floor = None if verdict is not None and not verdict.rollback else (
                self._floor[0], self._floor[1], self._elapsed)
        if verdict is None:
            return None, False, None
        # %g: a comparison whose old rate extrapolated to nearly 0 reads ~1e300 (weightless,
        # never confident), which %f spelled out in 300 digits
        log.info("switch %s -> %s: progress x%.4g (+-%.3g) of the old strategy's over %d "
                 "interval(s)%s, efficiency ratio %.3f, implied noise scale %.4g, probe bias "
                 "now x%.3g (sd of ln k %.2f)%s", old.name, new.name, verdict.observed,
                 verdict.stderr, seen, f" and {back} back" if bracketed and back else "",
                 verdict.efficiency_ratio, verdict.noise_scale, self.progress.bias,
                 self.progress.bias_sd,
                 (": left" if bracketed else ": rolled back") if verdict.rollback else "")
        # back on the old strategy after a bracket, the one of the two measured faster is run:
        # the trial is gone back to only where it read faster than the old strategy, on a
        # comparison the efficiency model allows (else the ranking decides)
        go = new if bracketed and verdict.consistent and verdict.observed >= 1.0 else None
        if verdict.rollback:
            self.tried[new] = self.noise_scale
        else:
            if go is not None:
                self.tried.pop(new, None)
            if verdict.held_up:
                self.tried[old] = self.noise_scale  # measured worse: no return on the estimate alone
                if new.global_batch_size > old.global_batch_size:
                    self._floor = (old, self.noise_scale, self._elapsed)
        return verdict, False, go

    def _floor_stale(self) -> bool:
        """A floor binds until the training time since it was set doubled; then the ranking's
        move below it is made as an experiment (held until its comparison is confident), kept
        only if it measurably paid, so that a floor set by a verdict read wrong through the
        loss's noise is measured again instead of binding for the rest of the run."""
        return self._floor is not None and self._elapsed >= 2.0 * self._floor[2]

    def _below_stale_floor(self, batch: int) -> bool:
        """Whether a move to ``batch`` would go below a floor that no longer binds."""
        return self._floor_stale() and batch <= self._floor[0].global_batch_size

    def _experiment(self, strategy: ParallelStrategy, ranking: list) -> list:
        """The estimate to try when the probe's bias is still unmeasured and the batch has not
        changed for ``explore_after`` rankings: the best at twice the running global batch (at
        half where there is no twice larger one, below), held until its comparison is
        confident or ``judge_intervals`` passed (``_check_last_switch``); empty: no experiment
        now."""
        cfg = self.config
        if not cfg.confirm or not cfg.explore_after or self.progress.calibrated \
                or self._same_batch < self._explore_wait:
            return []
        batch = strategy.global_batch_size
        # up, as the published biases (10-100x) say the probe reads low; down only where there
        # is no twice larger batch to try (a job on its largest batch could otherwise never
        # learn that the prior sits above the truth), when the bias's plausible low end would
        # choose a smaller batch and its high end no larger one
        target = 2 * batch
        if not any(e.strategy.global_batch_size == target for e in ranking):
            pool = [strategy, *(e.strategy for e in ranking)]
            mean, sd = self.progress.bias, self.progress.bias_sd
            low = self._best_at(pool, mean * math.exp(-sd)).global_batch_size
            high = self._best_at(pool, mean * math.exp(sd)).global_batch_size
            if low < batch and high <= batch:
                target = batch // 2
        if self._below_stale_floor(target):
            return []  # a stale floor is challenged by what the ranking prefers, not a probe
        # the trial: the one at the target batch expected to lose least for its goodput and
        # its three switches, among those on the running layout (a batch switch teaches the
        # same about the bias) or of a kind of switch already measured, never three layout
        # switches on a prior that a dear one would miss by orders of magnitude (a layout is
        # first changed by a ranking, whose switch must repay its cost); where none is, any
        trial = [e for e in ranking if e.strategy.global_batch_size == target]
        costs = self.policy.costs
        trial = sorted([e for e in trial if e.strategy.layout == strategy.layout
                        or costs.measured(strategy, e.strategy)] or trial,
                       key=lambda e: (self._shortfall(strategy, e), e.strategy.name))
        # an experiment whose comparison cannot tell the bias's plausible values apart costs its
        # intervals and teaches nothing (or, read through noise, the wrong thing): wait, the
        # wait not doubled, for longer intervals (they grow with the tokens seen) or a noise
        # scale near enough to the batch for the bias to show in the efficiency
        if trial and self.progress.expected_error(cfg.judge_intervals, cfg.bracket) \
                > self._resolvable(batch, trial[0].strategy.global_batch_size):
            return []
        # an experiment pays only through what it teaches: even knowing the bias exactly
        # must be worth, within the policy's horizon, what the trial is expected to lose in
        # the interval it runs (else wait, the wait not doubled)
        if trial and not self._learning_pays(strategy, trial[0], ranking):
            return []
        if trial:  # each experiment costs an interval: they get rarer (bounded cost)
            self._explore_wait *= 2
        return trial[:1]

    def _learning_pays(self, strategy: ParallelStrategy, trial: GoodputEstimate,
                       ranking: list[GoodputEstimate]) -> bool:
        """Whether knowing the probe's bias exactly (the posterior's mean of each bias's best
        goodput over the running strategy's, relative), repaid over the policy's horizon, is
        worth at least what ``trial`` is expected to lose in the interval it runs (one minus
        its posterior-averaged goodput over the running strategy's) plus the switches it takes
        (there, back, and with a bracket there again; each the seconds the switch cost model
        expects, as a share of an interval's training time). Knowing it exactly is the most an
        experiment can teach, so a trial that fails this cannot pay."""
        shortfall = self._shortfall(strategy, trial)  # there, back and (bracket) there again
        if not shortfall > 0:
            return True
        current = self.current_estimate(strategy)
        pool = [strategy, *(e.strategy for e in ranking)]
        times = {s: self.times.iteration_time(s) for s in pool}
        scales = {s: self._efficiency_lr_scale(s, self.noise_scale) for s in pool}

        value = 0.0
        for k, w in self.progress.bias_nodes:
            goodputs = [estimate(s, times[s], self.gns.noise_scale, self.config.base_batch,
                                 lr_scale=scales[s], bias=((k, 1.0),)).goodput for s in pool]
            value += w * (max(goodputs) - goodputs[0])  # pool[0]: the running strategy
        return value / current.goodput * self.policy.config.horizon_intervals >= shortfall

    def _shortfall(self, strategy: ParallelStrategy, trial: GoodputEstimate) -> float:
        """What an experiment on ``trial`` is expected to lose, in intervals of the running
        ``strategy``: one minus the trial's posterior-averaged goodput over the running one's,
        plus its switches' expected seconds as a share of an interval's training time."""
        trips = (2 + (self.config.bracket > 0)) * self.policy.costs.estimate(strategy,
                                                                             trial.strategy)
        return (1.0 - trial.goodput / self.current_estimate(strategy).goodput
                + trips / self._interval_seconds(strategy))

    def _interval_seconds(self, strategy: ParallelStrategy) -> float:
        """Training time since the last ranking (the policy's horizon is counted in these),
        or an interval's predicted time on ``strategy`` before one was observed."""
        return self._interval_time or (self.times.iteration_time(strategy)
                                       * self.config.interval)

    def _best_at(self, pool: list[ParallelStrategy], bias: float) -> ParallelStrategy:
        """The best of ``pool`` were the probe's bias exactly ``bias``."""
        phi = self.gns.noise_scale
        return rank(pool, self.times, phi, self.config.base_batch,
                    lambda s: self._efficiency_lr_scale(s, phi * bias), ((bias, 1.0),))[0].strategy

    def _resolvable(self, batch_old: int, batch_new: int) -> float:
        """The relative error a comparison from ``batch_old`` to ``batch_new`` may have and still
        teach about the probe's bias: the spread of the progress ratio it predicts (in ln)
        between the bias ``RESOLVE_SD`` posterior standard deviations below and above its mean.
        Where the noise scale is far below both batches (or far above) every plausible bias
        predicts the same ratio and no precision is enough."""
        phi, mean, sd = self.gns.noise_scale, self.progress.bias, self.progress.bias_sd
        if not phi > 0:
            return 0.0
        lo, hi = (math.log((k * phi + batch_old) / (k * phi + batch_new))
                  for k in (mean * math.exp(-RESOLVE_SD * sd), mean * math.exp(RESOLVE_SD * sd)))
        return abs(hi - lo)

    def decide(self, iteration: int, **log_extra) -> Decision:
        """Rank the candidates and decide whether to leave the running strategy (logged)."""
        strategy = self.executor.strategy
        verdict, hold, go = self._check_last_switch(strategy)
        self._experimenting = False
        phi = self.noise_scale
        pool, must_leave = self._pool(strategy)
        ranking = self._rank(pool)
        current = self.current_estimate(strategy, uncertainty=0.0)
        self._recommend(iteration, strategy, max(ranking[:1] + [current],
                                                 key=lambda e: e.goodput))
        if go is not None:
            # a bracket's move (back to the strategy an experiment left, or again to a trial
            # that paid): judged already, and never traded for the ranking's next strategy,
            # which nothing has measured
            self._judged_move = True
            must_leave = (f"bracketing the experiment on {self._bracketing[1].name}: "
                          f"{self.config.bracket} interval(s) back on {go.name}"
                          if verdict is None else
                          f"switch {verdict.old.name} -> {go.name} measured faster "
                          f"(x{verdict.observed:.3f} +- {verdict.stderr:.3f} of the old "
                          "strategy's rate, bracketed): back to it")
            ranking = [e for e in ranking if e.strategy == go] or [
                self.current_estimate(go, uncertainty=self.times.uncertainty(go))]
        elif hold:
            must_leave = None
        elif verdict is not None and verdict.rollback and strategy != verdict.old:
            # (a bracketed trial that lost is left already: the ranking decides from here)
            # a move below a floor that did not measurably pay is rolled back too
            outcome = "did not measurably pay" if verdict.paid else "lost progress"
            must_leave = (f"switch {verdict.old.name} -> {strategy.name} {outcome} "
                          f"(x{verdict.observed:.3f} +- {verdict.stderr:.3f} of the old "
                          "strategy's rate): rolled back")
            ranking = [e for e in ranking if e.strategy == verdict.old] or [
                self.current_estimate(verdict.old,
                                      uncertainty=self.times.uncertainty(verdict.old))]
        elif must_leave:
            ranking = [e for e in ranking if e.strategy != strategy]
        elif experiment := self._experiment(strategy, ranking):
            self._experimenting = True
            must_leave = ("the probe's noise scale is not yet checked against measured "
                          f"progress: trying {experiment[0].strategy.name} until measured "
                          "progress says whether it pays")
            ranking = experiment
        interval_s = self._interval_seconds(strategy)
        low = self.robust_gain(strategy, ranking[0].strategy) if ranking else math.nan
        decision = self.policy.decide(
            iteration, current, ranking, interval_s, phi, low, must_leave=must_leave,
            hold="an experiment is still measuring whether its batch pays"
            if hold and go is None else None)
        if decision.target != strategy and go is None \
                and self._below_stale_floor(decision.target.global_batch_size):
            self._experimenting = self._challenging = True
        self._interval_time = 0.0
        self._same_batch = 0 if decision.target.global_batch_size != \
            strategy.global_batch_size else self._same_batch + 1
        self.decisions.append(decision)
        self.log.write(decision, **log_extra)
        return decision

    # --------------------------------------------------------------------------------- act
    def begin(self) -> SwitchOutcome | None:
        """Before the first iteration: with ``start='smallest'`` move to the smallest candidate
        global batch that keeps the configured layout and micro-batch (a batch-only switch,
        which every executor can make) and on which the probe reads the noise scale; None
        when the run stays where it is."""
        current = self.executor.strategy
        if self.config.start != "smallest":
            return None
        same = [s for s in self.candidates if s.layout == current.layout
                and s.micro_batch == current.micro_batch
                and measures_noise(s.dp, s.num_microbatches)]
        if not same:
            return None
        target = min(same, key=lambda s: s.global_batch_size)
        if target.global_batch_size >= current.global_batch_size:
            return None
        log.info("CONA starts at %s (configured %s): the critical batch is smallest at the "
                 "start; the probe's first readings decide how it grows", target.name,
                 current.name)
        return self._switch(0, target, judge=False)

    def act(self, iteration: int, decision: Decision) -> SwitchOutcome | None:
        """Carry out ``decision`` through the executor; None when nothing was to be done or the
        executor cannot (recorded in :attr:`unsupported`)."""
        return self._switch(iteration, decision.target, judge=True)

    def _switch(self, iteration: int, target: ParallelStrategy, judge: bool
                ) -> SwitchOutcome | None:
        old = self.executor.strategy
        target = self.executor.agree(target)
        judged, self._judged_move = self._judged_move, False
        if target == old:
            return None
        try:
            outcome = self.executor.switch(target)
        except SwitchUnsupported as why:
            self.unsupported.append(Unsupported(iteration, target, str(why)))
            log.warning("iteration %d: CONA chose %s but cannot switch here: %s", iteration,
                        target.name, why)
            return None
        self.switches.append(SwitchRecord(iteration, old, target, outcome))
        if not outcome.switched:
            log.warning("iteration %d: switch to %s rolled back: %s", iteration, target.name,
                        outcome.error)
            return outcome
        self.policy.costs.record(old, target, outcome.seconds)
        if judge and not judged and old.global_batch_size != target.global_batch_size:
            self._judging = (old, target, self._experimenting, 0)
        self.executor.set_lr_scale(self.lr_scale(target))
        return outcome

    def after_step(self, iteration: int, seconds: float, stats: GradStats | None = None, *,
                   final: bool = False, loss: float | None = None,
                   **log_extra) -> Decision | None:
        """The loop's one call per iteration: observe; on ranking iterations (not the
        ``final`` one) decide and act. Returns the decision when one was made."""
        self.observe(seconds, stats, loss=loss)
        if final or not self.due(iteration):
            return None
        decision = self.decide(iteration, **log_extra)
        self.act(iteration, decision)
        return decision

    def lr_scale(self, strategy: ParallelStrategy) -> float:
        return self._lr.scale(strategy.global_batch_size, self.noise_scale)


def base_throughput(model: TransformerSpec, precision: str, device: str) -> ThroughputModel:
    """The trained time predictor for ``device`` ('auto': the local one); the analytical prior
    when ``predictors`` has no trained model here (logged: rankings then rely on calibration)."""
    try:
        from predictors import predict_iteration_time  # noqa: F401
    except ImportError:
        log.warning("predictors.predict_iteration_time unavailable: ranking unseen strategies "
                    "with the analytical prior, calibrated by measurement")
        return AnalyticalThroughput(model)
    return PredictorThroughput(model, precision, "local" if device == "auto" else device)


def memory_model_for(total_bytes: int, compute_major: int, args, world_size: int
                     ) -> PredictorMemory:
    """The memory filter for the job's own device and options: the GPU generation from its
    compute capability (Hopper's context and allocator overheads from 9.x on, never from the
    card's size alone), the distributed optimizer / FSDP and recompute from its flags."""
    options = from_megatron_args(args, world_size)[2]
    return PredictorMemory(total_bytes / 2**30, "hopper" if compute_major >= 9 else "pre-hopper",
                           options)


def session_from_args(args, settings: ConaSettings, model: TransformerSpec, world_size: int,
                      precision: str, executor: Executor, base: ThroughputModel | None = None,
                      write_log: bool = True, build_seconds: float | None = None
                      ) -> ConaSession:
    """The session ``--cona`` and its flags describe (candidates enumerated and filtered);
    ``write_log=False`` on all ranks but one keeps ``--cona-log`` single-writer.
    ``build_seconds``: how long building the job's training state took (slowest rank), a
    floor of a layout switch's cost, which builds the new layout's state the same way (groups,
    model, DDP buffers, optimizer) before it moves the bytes: the prior of a layout switch is
    the larger of it and :class:`SwitchCostModel`'s 1 s (:meth:`SwitchCostModel.for_build`),
    which a large job's build can exceed by far."""
    memory = {}
    if torch.cuda.is_available():  # drop candidates predicted not to fit this GPU
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        memory = dict(precision=get_precision(precision),
                      memory_model=memory_model_for(props.total_memory, props.major, args,
                                                    world_size),
                      memory_limit_bytes=props.total_memory)
    candidates = enumerate_candidates(world_size, model, settings.candidates, **memory)
    log.info("CONA: %d candidates, %d rejected", len(candidates), len(candidates.rejected))
    policy = SwitchPolicy(PolicyConfig(min_gain=settings.min_gain,
                                       horizon_intervals=args.cona_horizon,
                                       patience=args.cona_patience,
                                       cooldown=args.cona_cooldown),
                         SwitchCostModel.for_build(build_seconds))
    log.info("CONA: a layout switch is priced at %.3f s until one is measured",
             policy.costs.layout_prior_s)
    times = CalibratedThroughput(base or base_throughput(model, precision, args.cona_device))
    config = SessionConfig(interval=settings.interval, base_batch=args.global_batch_size,
                           lr_rule=args.cona_lr_scaling, start=args.cona_start,
                           probe_bias_prior=args.cona_probe_bias)
    return ConaSession(candidates.kept, times, policy, GradientNoiseScale(args.cona_gns_decay),
                       config, executor, DecisionLog(args.cona_log if write_log else None))
