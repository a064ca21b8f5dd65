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
* :class:`megatron_cona.ttp.chains.ReplayExecutor` -- the time-to-perplexity evaluation's simulated
  cluster (real training progress, simulated clock).

The session holds no engine objects; the executor reports the measured cost of each switch back,
and the learning rate follows the global batch through the one LR rule
(:func:`megatron_cona.lr_scaling.lr_scale`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_cona.arguments import ConaSettings
from megatron_cona.candidates import PredictorMemory, enumerate_candidates
from megatron_cona.executor import Executor, SwitchOutcome, SwitchUnsupported
from megatron_cona.gns import GradientNoiseScale, GradStats
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
from megatron_cona.policy import Decision, DecisionLog, PolicyConfig, SwitchPolicy
from predictors.spec import ParallelStrategy, TransformerSpec
from predictors.spec.precision import get_precision

log = logging.getLogger("megatron_cona.session")


@dataclass
class SessionConfig:
    interval: int = 50
    base_batch: int = 8  # the global batch the base learning rate was tuned for
    lr_rule: str = "sqrt"
    warmup_iterations: int = 0  # no ranking before this many iterations (noisy start)
    lr_table: dict[int, float] | None = None  # per-batch LR (rule 'table'), else lr_rule
    noise_z: float = 1.0  # standard errors of the noise scale a switch must survive

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

    # ----------------------------------------------------------------------------- observe
    def observe(self, seconds: float, stats: GradStats | None = None,
                iterations: float = 1.0) -> None:
        """One finished iteration of the running strategy that took ``seconds``; with
        ``iterations`` > 1 the reading stands for that many such iterations (a loop that reads
        the probe on every k-th iteration only)."""
        self.times.record(self.executor.strategy, seconds)
        self._interval_time += seconds * iterations
        sample = stats.sample() if stats is not None else None
        if sample is not None:
            self.gns.observe(sample)

    def due(self, iteration: int) -> bool:
        return iteration >= self.config.warmup_iterations and iteration % self.config.interval == 0

    # ------------------------------------------------------------------------ rank, decide
    def current_estimate(self, strategy: ParallelStrategy, phi: float | None = None,
                         uncertainty: float = 0.0) -> GoodputEstimate:
        phi = self.gns.noise_scale if phi is None else phi
        return estimate(strategy, self.times.iteration_time(strategy), phi,
                        self.config.base_batch, self.times.source(strategy), uncertainty,
                        self._efficiency_lr_scale(strategy, phi))

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

    def decide(self, iteration: int, **log_extra) -> Decision:
        """Rank the candidates and decide whether to leave the running strategy (logged)."""
        strategy = self.executor.strategy
        phi = self.gns.noise_scale
        ranking = rank(self.candidates, self.times, phi, self.config.base_batch,
                       lambda s: self._efficiency_lr_scale(s, phi))
        current = next((e for e in ranking if e.strategy == strategy), None) or (
            self.current_estimate(strategy))
        # training time since the last ranking: the policy's horizon is counted in these
        interval_s = self._interval_time or (self.times.iteration_time(strategy)
                                             * self.config.interval)
        low = self.robust_gain(strategy, ranking[0].strategy) if ranking else math.nan
        decision = self.policy.decide(iteration, current, ranking, interval_s, phi, low)
        self._interval_time = 0.0
        self.decisions.append(decision)
        self.log.write(decision, **log_extra)
        return decision

    # --------------------------------------------------------------------------------- act
    def act(self, iteration: int, decision: Decision) -> SwitchOutcome | None:
        """Carry out ``decision`` through the executor; None when nothing was to be done or the
        executor cannot (recorded in :attr:`unsupported`)."""
        old = self.executor.strategy
        target = self.executor.agree(decision.target)
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
        self.executor.set_lr_scale(self.lr_scale(target))
        return outcome

    def after_step(self, iteration: int, seconds: float, stats: GradStats | None = None, *,
                   final: bool = False, **log_extra) -> Decision | None:
        """The loop's one call per iteration: observe; on ranking iterations (not the
        ``final`` one) decide and act. Returns the decision when one was made."""
        self.observe(seconds, stats)
        if final or not self.due(iteration):
            return None
        decision = self.decide(iteration, **log_extra)
        self.act(iteration, decision)
        return decision

    def lr_scale(self, strategy: ParallelStrategy) -> float:
        return self._lr.scale(strategy.global_batch_size, self.gns.noise_scale)


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


def session_from_args(args, settings: ConaSettings, model: TransformerSpec, world_size: int,
                      precision: str, executor: Executor, base: ThroughputModel | None = None,
                      write_log: bool = True) -> ConaSession:
    """The session ``--cona`` and its flags describe (candidates enumerated and filtered);
    ``write_log=False`` on all ranks but one keeps ``--cona-log`` single-writer."""
    memory = {}
    if torch.cuda.is_available():  # drop candidates predicted not to fit this GPU
        capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        memory = dict(precision=get_precision(precision),
                      memory_model=PredictorMemory(capacity / 2**30),
                      memory_limit_bytes=capacity)
    candidates = enumerate_candidates(world_size, model, settings.candidates, **memory)
    log.info("CONA: %d candidates, %d rejected", len(candidates), len(candidates.rejected))
    policy = SwitchPolicy(PolicyConfig(min_gain=settings.min_gain,
                                       horizon_intervals=args.cona_horizon,
                                       patience=args.cona_patience,
                                       cooldown=args.cona_cooldown))
    times = CalibratedThroughput(base or base_throughput(model, precision, args.cona_device))
    config = SessionConfig(interval=settings.interval, base_batch=args.global_batch_size,
                           lr_rule=args.cona_lr_scaling)
    return ConaSession(candidates.kept, times, policy, GradientNoiseScale(args.cona_gns_decay),
                       config, executor, DecisionLog(args.cona_log if write_log else None))
