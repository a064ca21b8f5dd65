"""The Pollux chain's adapter to adaptdl's own goodput code (benchmarks/cona_pollux.py), checked
against adaptdl's example values (its goodput_test.py draws PerfParams/GradParams as
``RandomState(0).gamma(2.0, 2.0, ...)``). adaptdl is in the test environment, required in CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

adaptdl_goodput = pytest.importorskip(
    "adaptdl.goodput", reason="adaptdl.goodput: requirements/test-env.txt installs it")
np = pytest.importorskip("numpy")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cona_pollux import choose, grad_params, perf_observations, split_time  # noqa: E402

from megatron_cona.gns import GradientNoiseScale, GradStats, statistical_efficiency  # noqa: E402
from predictors.spec import ParallelStrategy  # noqa: E402

RNG = np.random.RandomState(0)
PERF = [adaptdl_goodput.PerfParams(*RNG.gamma(2.0, 2.0, [7])) for _ in range(10)]
GRAD = [adaptdl_goodput.GradParams(*RNG.gamma(2.0, 2.0, [2])) for _ in range(10)]
CANDIDATES = [ParallelStrategy(8, 1, 1, mb, gb) for gb in (8, 16, 32, 64, 128)
              for mb in (1, 2, 4, 8, 16) if gb % (8 * mb) == 0]


@pytest.mark.parametrize("grad", GRAD[:5])
def test_grad_params_give_adaptdl_the_noise_scale_cona_measures(grad):
    init = 8
    sqr, trace = float(grad.sqr), float(grad.var) * init  # adaptdl's var is at the init batch
    gns = GradientNoiseScale(0.5)
    for b in (16, 64):  # noise-free norms: E|g_b|^2 = |G|^2 + tr(S)/b
        gns.observe(GradStats([sqr + trace / (b // 2)] * 2, b // 2, sqr + trace / b, b).sample())
    ours = grad_params(gns, init)
    assert ours == pytest.approx((sqr, float(grad.var)))
    fn = adaptdl_goodput.GoodputFunction(PERF[0], ours, init)
    for batch in (8, 16, 64, 128):
        assert fn.efficiency(batch) == pytest.approx(
            statistical_efficiency(trace / sqr, batch, init))


@pytest.mark.parametrize("perf", PERF[:5])
def test_choice_is_adaptdl_optimize(perf):
    fn = adaptdl_goodput.GoodputFunction(perf, GRAD[1], 8)
    pick, info = choose(fn, CANDIDATES, 8)
    goodput, atomic, accum = fn.optimize(1, 8, max_batch_size=128, atomic_bsz_range=(1, 16),
                                         accumulation=True)
    assert info["atomic_bsz"] == atomic and info["accum_steps"] == accum
    want = 8 * atomic * (accum + 1)
    assert info["adaptdl_batch"] == want
    batches = sorted({s.global_batch_size for s in CANDIDATES})
    assert pick.global_batch_size == min(batches, key=lambda b: (abs(np.log(b / want)), b))
    if any(s.micro_batch == atomic and s.global_batch_size == pick.global_batch_size
           for s in CANDIDATES):
        assert pick.micro_batch == atomic


def test_fit_perf_params_recovers_adaptdl_example_times():
    """Step times made by adaptdl's own model from an example PerfParams, fed through our
    observations, are fitted back by fit_perf_params: the fitted throughputs agree."""
    perf = PERF[2]
    g = adaptdl_goodput
    seen = {}
    for s in CANDIDATES:
        accum = g._predict_accum_time(perf, s.micro_batch)
        network = g._predict_network_time(perf, np.array(1), np.array(s.dp))
        seen[s] = (float(accum), float(np.exp(g._predict_log_optim_time(perf, accum, network))))
    fitted = g.fit_perf_params(**perf_observations(seen))
    true_fn = g.GoodputFunction(perf, GRAD[0], 8)
    fit_fn = g.GoodputFunction(fitted, GRAD[0], 8)
    for s in CANDIDATES:
        args = (1, s.dp, s.micro_batch, s.num_microbatches - 1)
        assert fit_fn.throughput(*args) == pytest.approx(true_fn.throughput(*args), rel=0.25)


def test_split_time_uses_the_clock_line():
    from megatron_cona.lawsim.clock import GPT_1_3B, SimulatedClock, VTrainTimes

    clock = SimulatedClock(VTrainTimes(GPT_1_3B, 8), 0.1, 0.01, 300e9)
    s = ParallelStrategy(8, 1, 1, 1, 64)
    t = clock.iteration_time(s)
    accum, optim = split_time(clock, s, t)
    assert accum > 0 and optim > 0
    assert 7 * accum + optim == pytest.approx(t)
