"""TTP evaluation: the simulated clock (measured vTrain times, reshard-plan switch costs), real
curves (same data order, Megatron's ramp-up, bit-exact re-training) and a small end-to-end run
of every registered chain on cached curves."""

from __future__ import annotations

import json
import math

import pytest

from megatron_cona.ttp import exec_strategy
from megatron_cona.ttp.clock import GPT_1_3B, ClockError, SimulatedClock, VTrainTimes
from megatron_cpu.launch import run_distributed
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse


def _clock() -> SimulatedClock:
    return SimulatedClock(VTrainTimes(GPT_1_3B, 8), fixed_switch_s=0.25, batch_switch_s=0.002,
                          link_bytes_per_s=300e9)


def test_clock_charges_measured_times_and_measured_layout_lines():
    clock = _clock()
    assert len(clock.measured.table) == 90  # h2048, 24 layers, seq 1024 on 8 GPUs
    # row of ground_truth_single.csv: 8 GPUs, gb 16, mb 1, tp1 dp8 pp1 -> 215.029881 ms
    assert clock.iteration_time(P("dp8tp1pp1mb1gb16")) == pytest.approx(0.215029881)
    # gb 48 was not measured on dp8 mb1: the line through gb 16/32/64/128 of that layout
    t48 = clock.iteration_time(P("dp8tp1pp1mb1gb48"))
    assert clock.iteration_time(P("dp8tp1pp1mb1gb32")) < t48 < clock.iteration_time(
        P("dp8tp1pp1mb1gb64"))
    assert (clock.exact, clock.interpolated) == (3, 1)
    with pytest.raises(ClockError, match="dp8tp1pp1mb2gb16"):  # below gb 32..128: no line
        clock.iteration_time(P("dp8tp1pp1mb2gb16"))
    with pytest.raises(ClockError, match="dp1tp2pp4mb8gb64.*micro-batch 8"):
        clock.iteration_time(P("dp1tp2pp4mb8gb64"))  # vTrain measured that layout once


def test_switch_cost_is_plan_bytes_over_nvlink_plus_fixed_cost():
    clock = _clock()
    a, b = P("dp8tp1pp1mb1gb16"), P("dp1tp8pp1mb1gb16")
    assert clock.switch_time(a, a) == 0.0
    assert clock.switch_time(a, P("dp8tp1pp1mb2gb32")) == 0.002  # batch only
    # every rank of dp8 holds the whole state: tp8 shards are read locally, nothing moves
    assert clock.moved_bytes(a.layout, b.layout) == 0
    assert clock.switch_time(a, b) == 0.25
    # tp8 -> dp8: each rank receives the 7/8 of the (untied-vocab-padded) state it lacks
    moved = clock.moved_bytes(b.layout, a.layout)
    params = GPT_1_3B.num_parameters()
    assert 0.8 * params * 14 * 7 / 8 < moved < 1.1 * params * 14 * 7 / 8
    assert clock.switch_time(b, a) == pytest.approx(0.25 + moved / 300e9)


def test_exec_strategy():
    assert exec_strategy(64, 2) == ParallelStrategy(2, 1, 1, 16, 64)
    assert exec_strategy(4, 2) == ParallelStrategy(2, 1, 1, 2, 4)
    # one rank: at least two micro-batches (the first one is the small-batch gradient)
    assert exec_strategy(4, 1) == ParallelStrategy(1, 1, 1, 2, 4)
    assert exec_strategy(128, 1) == ParallelStrategy(1, 1, 1, 16, 128)


class _Recording:
    def __init__(self, inner) -> None:
        self.inner, self.seq_length, self.read = inner, inner.seq_length, []

    def samples(self, start, count):
        self.read.extend(range(start, start + count))
        return self.inner.samples(start, count)


def _curves(rank, world, cache_dir):
    """A static and a Megatron ramp-up curve read the same samples in the same order, and a
    second training of the same provenance is bit-exact."""
    from megatron_cona.data import CorpusConfig, build_corpus
    from megatron_cona.lr_scaling import BatchLR
    from megatron_cona.ttp.curves import Trainer, TrainerConfig, provenance, train_curve
    from megatron_cona.ttp.evaluate import TTPOptions, model_spec

    opts = TTPOptions()
    spec = model_spec(opts, "llama")
    corpus = build_corpus(CorpusConfig(seq_length=opts.seq_length, max_train_bytes=1 << 20))
    rec = _Recording(corpus.train)
    corpus.train = rec
    trainer = Trainer(TrainerConfig(spec, 7, 0, 1000, 0.1, 32), corpus)
    out = {"reads": [], "curves": []}
    rule = BatchLR(1e-3, 64)
    for ramp in (None, {"start": 16, "increment": 16, "samples": 96}):
        rec.read = []
        prov = provenance(code="t", engines={}, model=spec, seed=7, schedule={}, batch=64,
                          lr=1e-3, ramp=ramp, ranks=1)
        out["curves"].append(train_curve(trainer, prov, rule, 64, 256))
        out["reads"].append(list(rec.read))
    again = train_curve(trainer, out["curves"][1].provenance, rule, 64, 256)
    out["exact"] = again.same_numbers(out["curves"][1])
    return out


@pytest.mark.slow
@pytest.mark.megatron
def test_curves_same_data_order_megatron_ramp_and_bit_exact(tmp_path):
    res = run_distributed(_curves, 1, tmp_path, timeout=900)[0]
    static, ramp = res["reads"]
    assert static == list(range(256)) and ramp == list(range(len(ramp)))
    batches = [[e[3] for e in it] for it in res["curves"][1].stats]
    # megatron's calculator, 32 samples per increment over the first 96: 16 (at 0 and 16
    # consumed), 32 (32), 48 (64), then 64 past the ramp (112)
    assert [b for it in batches for b in it][:5] == [16, 16, 32, 48, 64]
    assert all(b == 64 for b in batches[-1])
    assert res["exact"]
    for curve in res["curves"]:
        assert curve.val_loss[-1] < curve.val_loss[0]
        assert all(e[1] < e[3] for it in curve.stats for e in it)  # small < big batch


def _ttp_opts(tmp_path):
    from megatron_cona.ttp import TTPOptions

    return TTPOptions(out=tmp_path / "out", cache=tmp_path / "cache", families=("gpt",),
                      seeds=(1234,), budget_samples=256, batches=(16, 64),
                      lr_grid=(2e-3,), lr_multipliers=(1.0,), rampup_starts=(16,),
                      rampup_fractions=(0.25,), interval_samples=64, val_samples=32,
                      warmup_samples=0, switch_repeats=1, max_samples_factor=1.5)


@pytest.mark.slow
@pytest.mark.megatron
def test_ttp_cases_on_cached_curves(tmp_path):
    from megatron_cona.ttp import run_ttp

    report = run_ttp(_ttp_opts(tmp_path), run_distributed)
    assert report["curves"]["bit_exact_check"]["bit_exact"]
    assert "SIMULATED" in report["note"] and "REAL" in report["note"]
    pred = report["predictor"]
    assert pred["held_out_group"] == "h2048-l24" and pred["train_rows"] == 1440 - 180
    cases = report["cases"]
    assert {c["variant"] for c in cases} == {"sqrt", "table"}
    for case in cases:
        ttp = case["ttp_s"]
        assert {"planner", "static", "cona", "bound"} <= set(ttp)
        assert math.isfinite(ttp["bound"]) and not case["bound_violations"]
        for name in ("planner", "static", "cona"):
            assert ttp["bound"] <= ttp[name] * (1 + 1e-9), (name, ttp)
        assert case["runs"]["planner"]["switches"] == []
    saved = json.loads((tmp_path / "out" / "ttp.json").read_text())
    assert set(saved["summary"]) == {"sqrt", "table"}
    assert (tmp_path / "out" / "ttp_gpt_s1234_table.png").stat().st_size > 10_000
    # a second run loads every curve from the cache
    again = run_ttp(_ttp_opts(tmp_path), run_distributed)
    assert again["curves"]["trained"] == 0 and again["curves"]["loaded"] > 0
    # switch costs are measured anew each run; chains without switches are identical
    for name in ("planner", "static"):
        assert again["cases"][0]["ttp_s"][name] == cases[0]["ttp_s"][name]
