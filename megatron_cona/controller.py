"""The CONA controller: measurement in, switch decisions out.

Every iteration the training loop hands it the running strategy, the iteration's time and the
gradient statistics; every ``interval`` iterations it ranks all candidates by goodput (measured
time for the running strategy, calibrated predictions for the others; statistical efficiency
from the gradient noise scale), asks the policy, and returns the decision. The loop performs the
switch (in memory, ``megatron_cona.reshard``) and reports its measured cost back. The controller
holds no engine objects, so the same code drives real runs and the simulated-clock evaluation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_cona.arguments import ConaSettings
from megatron_cona.candidates import PredictorMemory, enumerate_candidates
from megatron_cona.gns import GradientNoiseScale, GradientSample
from megatron_cona.goodput import (
    AnalyticalThroughput,
    CalibratedThroughput,
    GoodputEstimate,
    PredictorThroughput,
    ThroughputModel,
    estimate,
    rank,
)
from megatron_cona.lr_scaling import lr_scale
from megatron_cona.policy import Decision, DecisionLog, PolicyConfig, SwitchPolicy
from predictors.precision import get_precision
from predictors.spec import ParallelStrategy, TransformerSpec

log = logging.getLogger("megatron_cona.controller")


def gradient_sample(stats) -> GradientSample | None:
    """A :class:`GradientSample` from the runtime's ``GradStats``: data-parallel replicas when
    there are several, else the first micro-batch against the accumulated gradient."""
    if stats is None or not math.isfinite(stats.global_sq_norm):
        return None
    if len(stats.local_sq_norms) >= 2:
        return GradientSample.from_replicas(stats.local_sq_norms, stats.local_batch,
                                            stats.global_sq_norm)
    if stats.first_microbatch_sq_norm is not None and stats.micro_batch < stats.global_batch:
        return GradientSample((stats.first_microbatch_sq_norm,), stats.micro_batch,
                              stats.global_sq_norm, stats.global_batch)
    return None


@dataclass
class ControllerConfig:
    interval: int = 50
    base_batch: int = 8  # the global batch the base learning rate was tuned for
    lr_rule: str = "sqrt"
    warmup_iterations: int = 0  # no ranking before this many iterations (noisy start)


class ConaController:
    def __init__(
        self,
        candidates: Sequence[ParallelStrategy],
        times: CalibratedThroughput,
        policy: SwitchPolicy,
        gns: GradientNoiseScale,
        config: ControllerConfig,
        log: DecisionLog | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("candidates is empty")
        self.candidates = list(candidates)
        self.times = times
        self.policy = policy
        self.gns = gns
        self.config = config
        self.log = log or DecisionLog(None)
        self.decisions: list[Decision] = []
        self.switches: list[tuple[int, ParallelStrategy, ParallelStrategy, float]] = []
        self._interval_time = 0.0

    def observe(self, strategy: ParallelStrategy, seconds: float, stats=None) -> None:
        """One finished iteration of ``strategy`` that took ``seconds``."""
        self.times.record(strategy, seconds)
        self._interval_time += seconds
        sample = gradient_sample(stats)
        if sample is not None:
            self.gns.observe(sample)

    def due(self, iteration: int) -> bool:
        return iteration >= self.config.warmup_iterations and iteration % self.config.interval == 0

    def current_estimate(self, strategy: ParallelStrategy) -> GoodputEstimate:
        return estimate(strategy, self.times.iteration_time(strategy), self.gns.noise_scale,
                        self.config.base_batch, self.times.source(strategy))

    def decide(self, iteration: int, strategy: ParallelStrategy, **log_extra) -> Decision:
        """Rank the candidates and decide whether to leave ``strategy``; logs the decision."""
        phi = self.gns.noise_scale
        ranking = rank(self.candidates, self.times, phi, self.config.base_batch)
        current = next((e for e in ranking if e.strategy == strategy), None) or (
            self.current_estimate(strategy))
        # training time since the last ranking: the policy's horizon is counted in these
        interval_s = self._interval_time or (self.times.iteration_time(strategy)
                                             * self.config.interval)
        decision = self.policy.decide(iteration, current, ranking, interval_s, phi)
        self._interval_time = 0.0
        self.decisions.append(decision)
        self.log.write(decision, **log_extra)
        return decision

    def record_switch(self, iteration: int, old: ParallelStrategy, new: ParallelStrategy,
                      seconds: float) -> None:
        self.policy.costs.record(old, new, seconds)
        self.switches.append((iteration, old, new, seconds))

    def lr_scale(self, strategy: ParallelStrategy) -> float:
        return lr_scale(self.config.lr_rule, strategy.global_batch_size, self.config.base_batch,
                        self.gns.noise_scale)


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


def controller_from_args(args, settings: ConaSettings, model: TransformerSpec, world_size: int,
                         precision: str, base: ThroughputModel | None = None,
                         write_log: bool = True) -> ConaController:
    """The controller ``--cona`` and its flags describe (candidates enumerated and filtered);
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
    config = ControllerConfig(interval=settings.interval, base_batch=args.global_batch_size,
                              lr_rule=args.cona_lr_scaling)
    return ConaController(candidates.kept, times, policy, GradientNoiseScale(args.cona_gns_decay),
                          config, DecisionLog(args.cona_log if write_log else None))
