"""The law check's support (benchmarks/cona_curves.py, benchmarks/cona_law_check.py): curve keys
name the experiment and record what produced it; real training reads the same samples in the
same order at every batch and re-trains bit for bit; the hyperbola fit and the noise scale
recover known values; the committed curves are whole and fit."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cona_curves import (  # noqa: E402
    CODE_FILES,
    ROOT,
    Curve,
    CurveCache,
    CurveError,
    cache_key,
    code_hash,
    engine_versions,
    exec_strategy,
    provenance,
    tiny_spec,
)
from cona_law_check import (  # noqa: E402
    DATA,
    KERNEL_TOLERANCE,
    LawOptions,
    LawReport,
    Retrain,
    curve_provenance,
    fit_hyperbola,
    fit_target,
    noise_scale_at,
    plot_law,
    retrain_check,
    samples_to,
)

from megatron_cpu.launch import run_distributed  # noqa: E402
from predictors.spec import ParallelStrategy  # noqa: E402

SPEC = tiny_spec()


def _copy_tree(dst):
    for pattern in CODE_FILES:
        for path in ROOT.glob(pattern):
            target = dst / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


def _prov(code="c0", engines=None, seed=1, lr=1e-3, schedule=None, batch=16):
    return provenance(code=code, engines=engines or {"torch": "x"}, model=SPEC, seed=seed,
                      schedule=schedule or {"warmup": 256}, batch=batch, lr=lr, ranks=1)


def test_code_hash_follows_every_code_file(tmp_path):
    _copy_tree(tmp_path)
    before = code_hash(tmp_path)
    assert code_hash(tmp_path) == before  # deterministic
    step = tmp_path / "megatron_cona/runtime/step.py"
    step.write_text(step.read_text() + "\n# a change\n")
    assert code_hash(tmp_path) != before
    (tmp_path / "megatron_cona/data.py").unlink()
    with pytest.raises(CurveError, match="data.py"):
        code_hash(tmp_path)


def test_key_names_the_experiment_not_the_code_that_produced_it():
    base = cache_key(_prov())
    assert cache_key(_prov(code="c1", engines={"torch": "y"})) == base  # re-training decides
    for other in (_prov(seed=2), _prov(lr=2e-3), _prov(schedule={"warmup": 128}),
                  _prov(batch=32)):
        assert cache_key(other) != base


def test_cache_round_trip_and_provenance_check(tmp_path):
    prov = _prov()
    curve = Curve(cache_key(prov), prov, [0, 64], [5.0, 4.0], [float("nan"), 4.5],
                  [[(1.0, 8, 0.5, 16), (1.1, 8, 0.6, 16)]], 1.5)
    cache = CurveCache(tmp_path)
    assert cache.get(prov) is None
    cache.put(curve)
    got = cache.get(prov)
    assert got.val_loss == [5.0, 4.0] and got.same_numbers(curve)
    assert cache.get(_prov(code="later")).same_numbers(curve)  # found; its code is recorded
    assert cache.get(_prov(seed=9)) is None
    other = Curve(curve.key, prov, [0, 64], [5.0, 4.0 + 1e-12], curve.train_loss, curve.stats)
    assert not other.same_numbers(curve)  # bit-exact, not approximate
    # a file whose provenance does not match its key is refused, not silently used
    path = cache.path(curve.key)
    path.write_text(path.read_text().replace('"seed": 1', '"seed": 3'))
    with pytest.raises(CurveError, match="provenance differs"):
        cache.get(prov)


def test_max_rel_diff_reads_every_number_and_refuses_other_shapes():
    prov = _prov()
    base = Curve("k", prov, [0, 64], [5.0, 4.0], [math.nan, 4.5], [[(1.0, 8, 0.5, 16)]])
    same = Curve("k", prov, [0, 64], [5.0, 4.0], [math.nan, 4.5], [[(1.0, 8, 0.5, 16)]])
    assert base.max_rel_diff(same) == {"loss": 0.0, "grad_norm": 0.0}  # NaN against NaN
    norm = Curve("k", prov, [0, 64], [5.0, 4.0], [math.nan, 4.5], [[(1.0, 8, 0.501, 16)]])
    assert base.max_rel_diff(norm) == {"loss": 0.0, "grad_norm": pytest.approx(0.001 / 0.501)}
    train = Curve("k", prov, [0, 64], [5.0, 4.0], [math.nan, 4.6], base.stats)
    assert base.max_rel_diff(train) == {"loss": pytest.approx(0.1 / 4.6), "grad_norm": 0.0}
    for other in (Curve("k", prov, [0, 32], base.val_loss, base.train_loss, base.stats),
                  Curve("k", prov, [0, 64], base.val_loss, base.train_loss,
                        [[(1.0, 4, 0.5, 16)]])):
        assert set(base.max_rel_diff(other).values()) == {math.inf}
    assert base.max_rel_diff(Curve("k", prov, [0, 64], base.val_loss, [4.6, 4.5],
                                   base.stats))["loss"] == math.inf


def _retrain(want_engines, want_code, loss_scale, norm_scale=1.0):
    """Re-train a scripted committed curve whose provenance records ``want_engines`` and
    ``want_code``; the re-training gives its losses times ``loss_scale`` and its gradient norms
    times ``norm_scale``."""
    opts = LawOptions()
    prov = curve_provenance(opts, 8, want_code, want_engines)
    want = Curve(cache_key(prov), prov, [0, 64], [5.0, 4.0], [math.nan, 4.5],
                 [[(1.0, 2, 0.5, 8)]], 1.0)
    got = Curve(want.key, prov, [0, 64], [5.0 * loss_scale, 4.0], [math.nan, 4.5],
                [[(1.0, 2, 0.5 * norm_scale, 8)]], 1.0)

    def launch(fn, world, opts, provs, write, timeout):
        assert world == 1 and not write and provs[0]["batch"] == 8
        return [[got]]

    return retrain_check(opts, {8: want}, launch)


def test_retrain_accepts_other_cpu_kernels_within_tolerance_and_nothing_else():
    now, code = engine_versions(), code_hash()
    older = {k: v for k, v in now.items() if k != "cpu"}  # a curve from before the record
    other_cpu = now | {"cpu": "a different ISA"}
    loss_tol, norm_tol = KERNEL_TOLERANCE["loss"], KERNEL_TOLERANCE["grad_norm"]
    assert _retrain(now, code, 1.0) == Retrain(8, True)
    got = _retrain(older, code, 1 + loss_tol / 2, 1 + norm_tol / 2)
    assert not got.exact and got.max_rel["loss"] == pytest.approx(loss_tol / 2, rel=1e-3)
    assert f"cpu unrecorded -> {now['cpu']}" in got.text()
    assert _retrain(other_cpu, code, 1.0, 1 - norm_tol / 2).kernels == \
        f"a different ISA -> {now['cpu']}"
    # numpy does no arithmetic in training: its version beside the kernels keeps the tolerance
    assert not _retrain(other_cpu | {"numpy": "0.0"}, code, 1 + loss_tol / 2).exact
    refused = [(now, code, 1 + 1e-9, 1.0, "nothing recorded"),  # same kernels: bit for bit
               (other_cpu, code, 1 + 2 * loss_tol, 1.0, "loss 2.00e-04"),
               (other_cpu, code, 1.0, 1 + 3 * norm_tol, "grad_norm 2.9"),
               (other_cpu, "another code", 1 + 1e-9, 1.0, "code"),
               (other_cpu | {"torch": "0.0"}, code, 1 + 1e-9, 1.0, "torch 0.0"),
               # ... but alone it changes no kernel: bit for bit
               (now | {"numpy": "0.0"}, code, 1 + 1e-9, 1.0, "numpy 0.0")]
    for engines, c, loss_scale, norm_scale, named in refused:
        with pytest.raises(CurveError, match=named):
            _retrain(engines, c, loss_scale, norm_scale)


def test_exec_strategy():
    assert exec_strategy(64, 2) == ParallelStrategy(2, 1, 1, 16, 64)
    assert exec_strategy(4, 2) == ParallelStrategy(2, 1, 1, 2, 4)
    # one rank: at least two micro-batches (the first one is the small-batch gradient)
    assert exec_strategy(4, 1) == ParallelStrategy(1, 1, 1, 2, 4)
    assert exec_strategy(128, 1) == ParallelStrategy(1, 1, 1, 16, 128)
    with pytest.raises(CurveError, match="not divisible by ranks=2"):
        exec_strategy(5, 2)


def test_hyperbola_fit_recovers_known_law():
    s_min, e_min = 40.0, 400.0  # B_crit 10
    batches = [4, 8, 16, 32, 64]
    fit = fit_hyperbola(batches, [s_min + e_min / b for b in batches])
    assert fit[0] == pytest.approx(s_min) and fit[1] == pytest.approx(e_min)
    assert fit[2] == pytest.approx(1.0)
    # steps that do not fall with the batch at all: the hyperbola explains nothing
    assert fit_hyperbola(batches, [50.0, 70.0, 50.0, 70.0, 50.0])[2] < 0.2


def _synthetic(batch, s_min, e_min, target, noise):
    """A curve crossing ``target`` after S(B) = s_min + e_min / B steps, whose probe readings
    carry |G|^2 = 1 and tr(S) = ``noise`` exactly (expected squared norms)."""
    steps = s_min + e_min / batch
    cross = steps * batch
    samples = [0, int(cross // 2), int(cross), int(cross * 1.5)]
    val = [6.0, target + 0.5, target - 1e-9, target - 0.3]
    small = 2
    stat = (1.0 + noise / small, small, 1.0 + noise / batch, batch)
    return Curve("k", {"batch": batch}, samples, val, [math.nan] * 4,
                 [[stat] * 3 for _ in range(3)], 1.0)


def test_fit_target_recovers_bcrit_and_noise_scale():
    curves = {b: _synthetic(b, 40.0, 400.0, 3.0, 7.0) for b in (4, 8, 16, 32, 64)}
    assert samples_to(curves[8], 3.0) == pytest.approx(40 * 8 + 400, abs=1.0)
    fit = fit_target(curves, 3.0, 0.05)
    assert fit.b_crit == pytest.approx(10.0, rel=0.02) and fit.r2 > 0.999
    assert fit.b_noise == pytest.approx(7.0) and fit.k == pytest.approx(10 / 7, rel=0.02)
    assert noise_scale_at([curves[4]], 99.0, 0.05) != noise_scale_at([curves[4]], 3.0, 0.05)
    with pytest.raises(CurveError, match="reached by 0 of 5"):
        fit_target(curves, 1.0, 0.05)


def test_report_line_and_plot(tmp_path):
    curves = {b: _synthetic(b, 40.0, 400.0, 3.0, 7.0) for b in (4, 8, 16, 32, 64)}
    report = LawReport([fit_target(curves, 3.0, 0.05)], Retrain(8, True), 1.0, {}, curves)
    last = report.lines()[-1]
    assert last.startswith("law_r2=1.000 law_targets=1 law_batches=5 bcrit_over_noise=1.43")
    assert last.endswith("retrain_bit_exact=yes(batch=8)")
    png = plot_law(report, tmp_path / "law.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_options_refuse_too_few_batches():
    with pytest.raises(CurveError, match="batches"):
        LawOptions(batches=(8, 16))


def test_committed_curves_are_whole_and_fit():
    """The committed curves (benchmarks/data/cona_law) exist for the default options, carry
    their provenance, and give the hyperbola at every target; their numbers come from training
    (the benchmark re-trains one bit for bit: a timing-free, but not a quick, check)."""
    opts = LawOptions()
    cache = CurveCache(DATA)
    curves = {}
    for b in opts.batches:
        curve = cache.get(curve_provenance(opts, b, "any", {}))
        assert curve is not None, f"no committed curve for batch {b} in {DATA}"
        assert curve.provenance["code"] and curve.provenance["engines"]["megatron-core"]
        curves[b] = curve
    for target in opts.targets:
        fit = fit_target(curves, target, opts.noise_window)
        assert len(fit.batches) == len(opts.batches)
        assert fit.s_min > 0 and fit.e_min > 0 and math.isfinite(fit.b_noise)


def _train_twice(rank, world, data):
    """Two batches read the same samples in the same order; a second training of the same
    provenance is bit-exact."""
    import cona_law_check as law
    from cona_curves import code_hash, engine_versions

    opts = law.LawOptions(data=data, batches=(4, 8, 16), targets=(5.0,), max_samples=128,
                          val_samples=16, interval_samples=32, warmup_samples=0)
    provs = [law.curve_provenance(opts, b, code_hash(), engine_versions()) for b in (4, 8)]
    first = law._train_worker(rank, world, opts, provs, True)
    again = law._train_worker(rank, world, opts, provs[:1], False)[0]
    return first, again


@pytest.mark.slow
@pytest.mark.megatron
def test_real_curves_are_bit_exact_and_written(tmp_path):
    first, again = run_distributed(_train_twice, 1, tmp_path, timeout=900)[0]
    assert again.same_numbers(first[0])
    assert not again.same_numbers(first[1])
    for curve in first:
        assert curve.val_loss[-1] < curve.val_loss[0]  # it really trained
        assert all(e[1] < e[3] for it in curve.stats for e in it)  # small < big batch
        assert CurveCache(tmp_path).path(curve.key).exists()
