"""What a real job's gradient probe would read, simulated: per iteration the squared norms of
the small-batch gradients (each data-parallel replica's local gradient, or with one replica the
first micro-batch's) and of the big-batch (reduced / accumulated) gradient, as
:class:`~megatron_cona.gns.GradStats` -- the type the runtime and the Megatron-LM hook report.

With true gradient ``G`` and per-sample covariance ``S``, a gradient averaged over ``b`` samples
is ``G + noise`` with ``E|g_b|^2 = |G|^2 + tr(S)/b`` (McCandlish et al. 2018, App. A), and the
law sets ``B_noise = tr(S)/|G|^2 = B_crit`` (McCandlish: B_crit ~ B_noise). The noise is drawn
as an isotropic Gaussian in ``effective_dims`` dimensions, exactly, through the few chi-square
and normal variables the reported norms depend on; the norms are scale-free (``|G|^2 = 1``).
"""

from __future__ import annotations

import math

import numpy as np

from megatron_cona.gns import GradStats, measures_noise
from predictors.spec import ParallelStrategy


class SimulatedProbe:
    def __init__(self, rng: np.random.Generator, effective_dims: float) -> None:
        if not effective_dims >= 3:
            raise ValueError(f"effective_dims={effective_dims} must be >= 3")
        self.rng, self.dims = rng, effective_dims

    def read(self, strategy: ParallelStrategy, noise_scale: float) -> GradStats | None:
        """One iteration's readings under ``strategy`` when ``B_noise = noise_scale`` samples;
        None where the runtime measures nothing (one replica and one micro-batch). With
        PP > 1 the runtime sums every stage's first-micro-batch reading over the pipeline, which
        is the whole model's first-micro-batch norm: the same draw as PP = 1."""
        if not noise_scale >= 0 or math.isinf(noise_scale):
            raise ValueError(f"noise_scale={noise_scale} must be finite and >= 0")
        s = strategy
        local = s.micro_batch * s.num_microbatches
        if s.dp >= 2:
            small, big = self._replicas(s.dp, local, noise_scale)
            return GradStats([small] * s.dp, local, big, local * s.dp)
        if not measures_noise(s.dp, s.num_microbatches):
            return None
        small, big = self._first_micro(s.num_microbatches, s.micro_batch, noise_scale)
        return GradStats([big], s.global_batch_size, big, s.global_batch_size,
                         first_microbatch_sq_norm=small, micro_batch=s.micro_batch)

    def _replicas(self, k: int, b: int, trace: float) -> tuple[float, float]:
        """(mean over k replicas of |g_i|^2, |mean g_i|^2), each g_i over b samples: the
        estimator uses only the replicas' mean, which is drawn exactly here."""
        r, d = self.rng, self.dims
        var = trace / (b * d)  # per-dimension noise variance of one replica's gradient
        a_mean = r.normal(0.0, math.sqrt(1.0 / k))
        a_spread = r.chisquare(k - 1)
        w_mean = r.chisquare(d - 1) / k
        w_spread = r.chisquare((k - 1) * (d - 1))
        along = (1.0 + math.sqrt(var) * a_mean) ** 2
        small = along + var * (a_spread / k + w_mean + w_spread / k)
        return small, along + var * w_mean

    def _first_micro(self, m: int, mu: int, trace: float) -> tuple[float, float]:
        """(|g_1|^2, |mean of m micro-batch gradients|^2), each micro-batch over mu samples."""
        r, d = self.rng, self.dims
        sd = math.sqrt(trace / (mu * d))
        a1, a_rest = r.normal(), r.normal(0.0, math.sqrt(1.0 / (m - 1)))
        w1 = math.sqrt(r.chisquare(d - 1))
        c = r.normal(0.0, math.sqrt(1.0 / (m - 1)))  # rest's mean along w1
        perp = r.chisquare(d - 2) / (m - 1)  # and its squared norm across w1
        small = (1.0 + sd * a1) ** 2 + sd * sd * w1 * w1
        a_mean = (a1 + (m - 1) * a_rest) / m
        w_mean_sq = ((w1 + (m - 1) * c) ** 2 + (m - 1) ** 2 * perp) / (m * m)
        return small, (1.0 + sd * a_mean) ** 2 + sd * sd * w_mean_sq
