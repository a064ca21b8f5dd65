"""Goodput = throughput x statistical efficiency, for the running strategy (measured time) and
for every other candidate (predicted time, calibrated by what the strategies already run
measured)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatron_cona.gns import statistical_efficiency
from predictors.spec import ParallelStrategy, TransformerSpec
from predictors.spec.precision import Precision

EXACT = ((1.0, 1.0),)  # the noise scale taken as it is


class ThroughputModel(Protocol):
    """Seconds of one training iteration (one global batch) under ``strategy``."""

    def iteration_time(self, strategy: ParallelStrategy) -> float: ...


@dataclass
class PredictorThroughput:
    """The time predictor of ``predictors/`` for one model, precision and device."""

    model: TransformerSpec
    precision: Precision | str
    device: str

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        from predictors import predict_iteration_time

        return float(predict_iteration_time(self.model, strategy, self.precision, self.device))


@dataclass
class CalibratedThroughput:
    """Measured time for strategies that ran; predictions scaled by measured/predicted.

    The ratio of a layout that ran is used for its other batch sizes; layouts never run get the
    geometric mean ratio of all those that did. Measurements are smoothed by an EMA because a
    single iteration can be hit by a contention spike.
    """

    base: ThroughputModel
    # the time predictor's measured held-out relative error for this kind of job (a new model
    # size, GPU count or framework): the margin an unmeasured strategy must win by at first.
    # Default: the predictors' held-out development errors (docs/predictors-time.md: new
    # model 7.9%, new GPU count 13.4%); a caller that knows its job's figure passes it
    prior_error: float = 0.1
    decay: float = 0.7
    measured: dict[ParallelStrategy, float] = field(default_factory=dict)
    _predicted: dict[ParallelStrategy, float] = field(default_factory=dict, repr=False)

    def predicted(self, strategy: ParallelStrategy) -> float:
        if strategy not in self._predicted:
            self._predicted[strategy] = self.base.iteration_time(strategy)
        return self._predicted[strategy]

    def record(self, strategy: ParallelStrategy, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        old = self.measured.get(strategy)
        self.measured[strategy] = seconds if old is None else (
            self.decay * old + (1 - self.decay) * seconds)

    def _log_ratios(self) -> dict[tuple[int, int, int], list[float]]:
        out: dict[tuple[int, int, int], list[float]] = {}
        for strategy, seconds in self.measured.items():
            out.setdefault(strategy.layout, []).append(
                math.log(seconds / self.predicted(strategy)))
        return out

    def ratio(self, strategy: ParallelStrategy) -> float:
        ratios = self._log_ratios()
        if strategy.layout in ratios:
            values = ratios[strategy.layout]
        else:
            values = [r for rs in ratios.values() for r in rs]
        return math.exp(sum(values) / len(values)) if values else 1.0

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        if strategy in self.measured:
            return self.measured[strategy]
        return self.predicted(strategy) * self.ratio(strategy)

    def uncertainty(self, strategy: ParallelStrategy) -> float:
        """Relative error to expect from this strategy's time: 0 when measured; else the spread
        (std of log measured/predicted) once three strategies calibrate it; before that
        :attr:`prior_error`, the predictor's measured held-out error for this kind of job."""
        if strategy in self.measured:
            return 0.0
        logs = [r for rs in self._log_ratios().values() for r in rs]
        if len(logs) < 3:
            return self.prior_error
        mean = sum(logs) / len(logs)
        spread = math.sqrt(sum((r - mean) ** 2 for r in logs) / (len(logs) - 1))
        return math.expm1(spread)

    def source(self, strategy: ParallelStrategy) -> str:
        if strategy in self.measured:
            return "measured"
        return "calibrated" if self.measured else "predicted"


@dataclass(frozen=True)
class GoodputEstimate:
    strategy: ParallelStrategy
    iteration_time: float  # seconds per global batch
    throughput: float  # samples (sequences) per second
    efficiency: float  # statistical efficiency relative to the base batch
    goodput: float  # throughput * efficiency: base-batch-equivalent samples per second
    time_source: str  # measured | calibrated | predicted
    uncertainty: float = 0.0  # expected relative error of iteration_time

    def as_dict(self) -> dict:
        return {"strategy": self.strategy.name, "iteration_time_s": self.iteration_time,
                "throughput": self.throughput, "efficiency": self.efficiency,
                "goodput": self.goodput, "time_source": self.time_source,
                "uncertainty": self.uncertainty}


def estimate(
    strategy: ParallelStrategy,
    iteration_time: float,
    noise_scale: float,
    base_batch: int,
    time_source: str = "measured",
    uncertainty: float = 0.0,
    lr_scale: float | None = None,
    bias: Sequence[tuple[float, float]] = EXACT,
) -> GoodputEstimate:
    """``lr_scale``: the multiplier the LR rule applies at this batch (None: AdaScale's gain,
    Pollux's assumption); the efficiency term follows the rule actually applied. ``bias``:
    what the true noise scale is believed to be, as ``(k, weight)`` multiples of
    ``noise_scale``; the efficiency is its expectation over them."""
    batch = strategy.global_batch_size
    throughput = batch / iteration_time
    eff = sum(w * statistical_efficiency(noise_scale * k, batch, base_batch, lr_scale)
              for k, w in bias)
    return GoodputEstimate(strategy, iteration_time, throughput, eff, throughput * eff,
                           time_source, uncertainty)


def rank(
    candidates: Iterable[ParallelStrategy],
    times: CalibratedThroughput,
    noise_scale: float,
    base_batch: int,
    lr_scale: Callable[[ParallelStrategy], float | None] = lambda s: None,
    bias: Sequence[tuple[float, float]] = EXACT,
) -> list[GoodputEstimate]:
    """Candidates by goodput, best first (ties broken by name for determinism across ranks)."""
    estimates = [
        estimate(s, times.iteration_time(s), noise_scale, base_batch, times.source(s),
                 times.uncertainty(s), lr_scale(s), bias)
        for s in candidates
    ]
    return sorted(estimates, key=lambda e: (-e.goodput, e.strategy.name))


@dataclass(frozen=True)
class AnalyticalThroughput:
    """Roofline-style prior used when the trained time predictor is not installed: compute
    6*N*tokens FLOPs over the devices, the pipeline bubble, tensor-parallel activation
    all-reduces, the data-parallel gradient all-reduce and a fixed cost per micro-batch and
    layer. Its absolute scale does not matter: CalibratedThroughput rescales it by measurement."""

    model: TransformerSpec
    flops_per_s: float = 50e9
    link_bytes_per_s: float = 5e9
    overhead_s: float = 2e-4  # per micro-batch per layer (kernel launches, Python)
    bytes_per_element: int = 4

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        m, s = self.model, strategy
        tokens = s.global_batch_size * m.seq_length
        compute = 6.0 * m.num_parameters() * tokens / (self.flops_per_s * s.world_size)
        bubble = (s.num_microbatches + s.pp - 1) / s.num_microbatches
        act = s.micro_batch * m.seq_length * m.hidden_size * self.bytes_per_element
        tp_comm = (4 * m.num_layers / s.pp * act * 2 * (s.tp - 1) / s.tp / self.link_bytes_per_s
                   * s.num_microbatches)
        dp_comm = (2 * m.num_parameters() / (s.tp * s.pp) * self.bytes_per_element
                   * (s.dp - 1) / s.dp / self.link_bytes_per_s)
        overhead = self.overhead_s * (s.num_microbatches + s.pp - 1) * m.num_layers / s.pp
        return (compute + tp_comm) * bubble + dp_comm + overhead
