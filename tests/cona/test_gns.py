import math

import numpy as np
import pytest

from megatron_cona.gns import (
    BiasCorrectedEMA,
    GradientNoiseScale,
    GradientSample,
    GradientStatsError,
    statistical_efficiency,
    unbiased_estimates,
)
from megatron_cona.lr_scaling import LRScalingError, lr_scale

# Per-sample gradients g ~ N(mu, Sigma): |G|^2 = |mu|^2 and tr(S) = tr(Sigma) in closed form.
RNG = np.random.default_rng(0)
DIM = 50
MU = RNG.normal(size=DIM) * 0.3
A = RNG.normal(size=(DIM, DIM)) / math.sqrt(DIM)
SIGMA = A @ A.T * 4.0
TRUE_G2 = float(MU @ MU)
TRUE_TR = float(np.trace(SIGMA))


def replica_grads(replicas, local_batch, rng):
    per_sample = rng.multivariate_normal(MU, SIGMA, size=(replicas, local_batch))
    return per_sample.mean(axis=1)  # one gradient per data-parallel replica


def test_single_step_estimators_are_unbiased():
    rng = np.random.default_rng(1)
    g2s, trs, bigs = [], [], []
    for _ in range(3000):
        g = replica_grads(4, 2, rng)
        small = float(np.mean((g**2).sum(axis=1)))
        big = float((g.mean(axis=0) ** 2).sum())
        g2, tr = unbiased_estimates(small, big, 2, 8)
        g2s.append(g2)
        trs.append(tr)
        bigs.append(big)
    assert np.mean(g2s) == pytest.approx(TRUE_G2, rel=0.1)
    assert np.mean(trs) == pytest.approx(TRUE_TR, rel=0.05)
    # the naive |g_big|^2 is biased by tr(S)/8, the estimator removes that bias
    assert np.mean(bigs) == pytest.approx(TRUE_G2 + TRUE_TR / 8, rel=0.05)
    assert np.mean(bigs) > TRUE_G2 * 1.5


def test_ema_noise_scale_converges_to_closed_form():
    rng = np.random.default_rng(2)
    gns = GradientNoiseScale(decay=0.99)
    for _ in range(1500):
        g = replica_grads(4, 4, rng)
        sample = GradientSample.from_replicas([float((x**2).sum()) for x in g], 4,
                                              float((g.mean(0) ** 2).sum()))
        gns.observe(sample)
    assert gns.noise_scale == pytest.approx(TRUE_TR / TRUE_G2, rel=0.25)


def test_bias_correction_removes_zero_start():
    ema = BiasCorrectedEMA(0.9)
    ema.update(5.0)
    assert ema.value == pytest.approx(5.0)
    ema.update(5.0)
    assert ema.value == pytest.approx(5.0)
    assert math.isnan(BiasCorrectedEMA(0.9).value)


def test_efficiency_and_lr_rules():
    phi = 64.0
    assert statistical_efficiency(phi, 8, 8) == 1.0
    assert statistical_efficiency(phi, 64, 8) == pytest.approx(72 / 128)
    assert statistical_efficiency(math.nan, 64, 8) == 1.0
    assert lr_scale("sqrt", 32, 8) == pytest.approx(2.0)
    assert lr_scale("linear", 32, 8) == pytest.approx(4.0)
    assert 1.0 < lr_scale("adascale", 32, 8, phi) < 4.0
    assert lr_scale("none", 32, 8) == 1.0
    with pytest.raises(LRScalingError, match="cona-lr-scaling"):
        lr_scale("cubic", 32, 8)


def test_bad_statistics_are_named():
    with pytest.raises(GradientStatsError, match="small_sq"):
        unbiased_estimates(math.nan, 1.0, 1, 4)
    with pytest.raises(GradientStatsError, match="big_batch"):
        unbiased_estimates(1.0, 1.0, 4, 4)
    with pytest.raises(GradientStatsError, match="small_sq is empty"):
        GradientNoiseScale().observe(GradientSample((), 4, 1.0, 8))


def test_efficiency_follows_the_lr_rule_applied():
    """Pollux's (phi+M0)/(phi+M) assumes AdaScale's LR; under sqrt scaling a step is worth at
    most the LR multiplier, so small batches gain less when the noise scale is small."""
    assert statistical_efficiency(0.0, 16, 64) == pytest.approx(4.0)  # Pollux: M0/M
    assert statistical_efficiency(0.0, 16, 64, lr_scale=0.5) == pytest.approx(2.0)  # sqrt
    # large noise scale: the AdaScale gain is below the sqrt multiplier, Pollux's term holds
    assert statistical_efficiency(1e6, 16, 64, lr_scale=0.5) == pytest.approx(
        statistical_efficiency(1e6, 16, 64))
    # larger batch under sqrt: capped by sqrt(M/M0) once the gain exceeds it
    assert statistical_efficiency(1e6, 256, 64, lr_scale=2.0) == pytest.approx(0.5)


def test_noise_scale_range_from_measured_spread():
    from megatron_cona.gns import GradientSample

    steady = GradientNoiseScale(0.9)
    for _ in range(20):  # noise-free: |G|^2 = 1, tr(S) = 8
        steady.observe(GradientSample((1 + 8 / 4,), 4, 1 + 8 / 16, 16))
    lo, hi = steady.noise_scale_range()
    assert lo == pytest.approx(8.0) and hi == pytest.approx(8.0)
    noisy = GradientNoiseScale(0.9)
    for k in range(20):
        jitter = 0.5 if k % 2 else -0.5
        noisy.observe(GradientSample((1 + 8 / 4 + jitter,), 4, 1 + 8 / 16, 16))
    lo, hi = noisy.noise_scale_range()
    assert lo < noisy.noise_scale < hi
    assert all(math.isnan(x) for x in GradientNoiseScale(0.9).noise_scale_range())


def test_probe_reads_the_first_micro_batch_in_pipeline_order():
    """GradProbe.attach on a module run in 1F1B's order on a middle stage (two forwards in
    flight, then the backwards in order): the reading is the first micro-batch's gradient
    alone, as accumulated into ``main_grad`` (Megatron's DDP), whatever came after it."""
    import torch

    from megatron_cona.grad_probe import GradProbe
    from predictors.spec import ParallelStrategy

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    def accumulate(p):
        p.main_grad.add_(p.grad)
        p.grad = None

    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
        p.register_post_accumulate_grad_hook(accumulate)
    xs = [torch.randn(2, 4) for _ in range(3)]

    def parts():  # this rank's part: the squared norm of main_grad
        return sum(float(p.main_grad.pow(2).sum()) for p in layer.parameters()), None

    probe = GradProbe()
    probe.attach(layer, parts)
    probe.start(True, ParallelStrategy(1, 1, 2, 2, 6))  # PP = 2, three micro-batches
    outs = [layer(x) for x in xs[:2]]  # warm-up: two forwards before the first backward
    outs[0].pow(2).sum().backward()
    outs.append(layer(xs[2]))
    outs[1].pow(2).sum().backward()
    outs[2].pow(2).sum().backward()
    probe.before_reduction(parts, lambda local, tied: local)

    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    ref(xs[0]).pow(2).sum().backward()
    first = sum(float(p.grad.pow(2).sum()) for p in ref.parameters())
    assert probe.first_micro_sq == pytest.approx(first * 3**2, rel=1e-6)
    assert probe.local_sq == pytest.approx(parts()[0], rel=1e-9) and probe.local_sq > first
    probe.start(True, ParallelStrategy(1, 1, 1, 6, 6))  # one micro-batch: nothing to read
    assert not probe.first_micro
