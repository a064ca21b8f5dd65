"""Gradient noise scale and statistical efficiency from live gradient statistics.

For a gradient averaged over ``b`` i.i.d. samples with true gradient ``G`` and per-sample
covariance ``S``: ``E|g_b|^2 = |G|^2 + tr(S)/b``. Two batch sizes ``b_small < b_big`` (one data-
parallel replica's local gradient before the reduction, and the reduced global gradient after;
or, with one replica, one micro-batch's gradient and the accumulated one) give unbiased
estimates of ``|G|^2`` and ``tr(S)`` (McCandlish et al. 2018, appendix A). Their ratio is noisy,
so numerator and denominator are smoothed separately with a bias-corrected EMA before dividing
(as Pollux does). The noise scale ``phi = tr(S)/|G|^2`` is in samples (sequences).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class GradientStatsError(ValueError):
    """Gradient statistics that cannot be used (NaN/inf norms, bad batch sizes)."""


def unbiased_estimates(
    small_sq: float, big_sq: float, small_batch: float, big_batch: float
) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(S))`` from squared norms at two batch sizes."""
    if not small_batch > 0 or not big_batch > small_batch:
        raise GradientStatsError(
            f"batch sizes small_batch={small_batch}, big_batch={big_batch}: need 0 < small < big"
        )
    for name, value in (("small_sq", small_sq), ("big_sq", big_sq)):
        if not math.isfinite(value) or value < 0:
            raise GradientStatsError(f"{name}={value} is not a finite squared norm")
    grad_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace_cov = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sq, trace_cov


class BiasCorrectedEMA:
    """Exponential moving average whose zero start is divided out (Adam-style); it also keeps
    the EMA of squares, so the spread of the averaged observations is known."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise GradientStatsError(f"decay={decay} must be in [0, 1)")
        self.decay = decay
        self._biased = 0.0
        self._biased_sq = 0.0
        self._weight = 0.0
        self._weight_sq = 0.0  # sum of squared normalized weights: the effective sample count

    def update(self, value: float, decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        self._biased = d * self._biased + (1.0 - d) * value
        self._biased_sq = d * self._biased_sq + (1.0 - d) * value * value
        self._weight_sq = d * d * self._weight_sq + (1.0 - d) ** 2
        self._weight = d * self._weight + (1.0 - d)

    @property
    def value(self) -> float:
        if self._weight == 0.0:
            return math.nan
        return self._biased / self._weight

    @property
    def standard_error(self) -> float:
        """Standard error of :attr:`value` as a weighted mean of the observations (inf with
        fewer than two effective observations)."""
        if self._weight == 0.0:
            return math.inf
        mean = self.value
        var = max(self._biased_sq / self._weight - mean * mean, 0.0)
        share = self._weight_sq / self._weight**2  # 1 / effective number of observations
        return math.sqrt(var * share) if share < 1.0 else math.inf

    def state_dict(self) -> dict[str, float]:
        return {"decay": self.decay, "biased": self._biased, "weight": self._weight,
                "biased_sq": self._biased_sq, "weight_sq": self._weight_sq}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.decay, self._biased, self._weight = state["decay"], state["biased"], state["weight"]
        self._biased_sq = state.get("biased_sq", 0.0)
        self._weight_sq = state.get("weight_sq", 0.0)


@dataclass(frozen=True)
class GradientSample:
    """One iteration's statistics: squared norms of the ``small`` gradients (one per replica or
    micro-batch, each over ``small_batch`` samples) and of their mean over ``big_batch``."""

    small_sq: Sequence[float]
    small_batch: int
    big_sq: float
    big_batch: int

    @classmethod
    def from_replicas(cls, replica_sq: Sequence[float], local_batch: int, global_sq: float):
        return cls(tuple(replica_sq), local_batch, global_sq, local_batch * len(replica_sq))


@dataclass
class GradStats:
    """Squared gradient norms of one iteration, as a training loop measures them: every
    data-parallel replica's local gradient (before the reduction), the reduced gradient, and
    optionally the first micro-batch's gradient (the small batch when there is one replica).
    Norms are of unscaled gradients (no fp16 loss scale)."""

    local_sq_norms: list[float]  # one per DP replica, gradient of its local mean loss
    local_batch: int  # samples behind each local gradient
    global_sq_norm: float  # after DP reduction
    global_batch: int
    first_microbatch_sq_norm: float | None = None  # per replica 0's first micro-batch
    micro_batch: int = 1

    def sample(self) -> GradientSample | None:
        """The two batch sizes to estimate from: the replicas when there are several, else the
        first micro-batch against the accumulated gradient; None when neither exists."""
        if not math.isfinite(self.global_sq_norm):
            return None
        if len(self.local_sq_norms) >= 2:
            return GradientSample.from_replicas(self.local_sq_norms, self.local_batch,
                                                self.global_sq_norm)
        if self.first_microbatch_sq_norm is not None and self.micro_batch < self.global_batch:
            return GradientSample((self.first_microbatch_sq_norm,), self.micro_batch,
                                  self.global_sq_norm, self.global_batch)
        return None


def measures_noise(dp: int, num_microbatches: int) -> bool:
    """Whether a layout gives the probe a small/large gradient pair: two or more data-parallel
    replicas, or two or more micro-batches whatever the pipeline depth (each stage reads its
    gradient after the first micro-batch's backward). DP = 1 with one micro-batch is the one
    blind layout: the noise scale is not measured while it runs."""
    return dp >= 2 or num_microbatches >= 2


class GradientNoiseScale:
    """Running estimate of ``|G|^2``, ``tr(S)`` and ``phi = tr(S)/|G|^2``."""

    def __init__(self, decay: float = 0.95, per_samples: float | None = None) -> None:
        """``decay`` per observation, or per ``per_samples`` training samples when given (so
        the averaging window covers the same data whatever the batch size)."""
        self.grad_sq = BiasCorrectedEMA(decay)
        self.trace_cov = BiasCorrectedEMA(decay)
        self.per_samples = per_samples
        self.samples = 0

    def observe(self, sample: GradientSample) -> None:
        if not sample.small_sq:
            raise GradientStatsError("small_sq is empty: need >= 1 replica or micro-batch norm")
        small = sum(sample.small_sq) / len(sample.small_sq)
        g2, tr = unbiased_estimates(small, sample.big_sq, sample.small_batch, sample.big_batch)
        decay = None
        if self.per_samples:
            decay = self.grad_sq.decay ** (sample.big_batch / self.per_samples)
        self.grad_sq.update(g2, decay)
        self.trace_cov.update(tr, decay)
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples > 0

    @property
    def noise_scale(self) -> float:
        """``phi`` in samples; small ``|G|^2`` estimates are floored so phi stays finite."""
        if not self.ready:
            return math.nan
        g2 = self.grad_sq.value
        tr = max(self.trace_cov.value, 0.0)
        return tr / max(g2, 1e-12 * max(tr, 1e-30))

    def noise_scale_range(self, z: float = 1.0) -> tuple[float, float]:
        """``phi`` at ``z`` standard errors of the two smoothed estimates either way (the
        measured uncertainty of the noise scale); (nan, nan) before any observation."""
        if not self.ready:
            return math.nan, math.nan
        g2, tr = self.grad_sq.value, max(self.trace_cov.value, 0.0)
        dg, dt = z * self.grad_sq.standard_error, z * self.trace_cov.standard_error
        floor = 1e-12 * max(tr, 1e-30)
        low = max(tr - dt, 0.0) / max(g2 + dg, floor)
        high = math.inf if g2 - dg <= floor else (tr + dt) / (g2 - dg)
        return low, high

    def converged(self, tolerance: float = 1.0, z: float = 1.0) -> bool:
        """Whether ``phi`` is known within a factor ``1 + tolerance`` either way at ``z``
        standard errors (the condition for entering a layout that cannot re-measure it)."""
        phi = self.noise_scale
        if self.samples < 2 or not phi > 0:
            return False
        low, high = self.noise_scale_range(z)
        return high <= phi * (1 + tolerance) and low >= phi / (1 + tolerance)

    def efficiency(self, batch: float, base_batch: float) -> float:
        return statistical_efficiency(self.noise_scale, batch, base_batch)

    def state_dict(self) -> dict:
        return {"grad_sq": self.grad_sq.state_dict(), "trace_cov": self.trace_cov.state_dict(),
                "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.grad_sq.load_state_dict(state["grad_sq"])
        self.trace_cov.load_state_dict(state["trace_cov"])
        self.samples = state["samples"]


def statistical_efficiency(noise_scale: float, batch: float, base_batch: float,
                           lr_scale: float | None = None) -> float:
    """Progress per sample at ``batch`` relative to ``base_batch``.

    Pollux's ``(phi + base) / (phi + batch)`` assumes the learning rate follows the AdaScale
    gain ``r``; a step is worth ``r`` base steps. Under another LR rule (``lr_scale``: the
    multiplier the rule applies at ``batch``) a step is worth at most the LR multiplier, so the
    step's worth is ``min(lr_scale, r)`` base steps and the efficiency that worth over
    ``batch / base``. With no estimate yet, batch-size-neutral (1.0)."""
    if math.isnan(noise_scale):
        return 1.0
    pollux = (noise_scale + base_batch) / (noise_scale + batch)
    if lr_scale is None:
        return pollux
    gain = batch / base_batch * pollux
    return min(lr_scale, gain) / (batch / base_batch)


def adascale_gain(noise_scale: float, batch: float, base_batch: float) -> float:
    """AdaScale gain ``r``: how many base-batch steps one step at ``batch`` is worth."""
    return batch / base_batch * statistical_efficiency(noise_scale, batch, base_batch)
