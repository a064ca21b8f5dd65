"""Fleet scoring: efficiencies fitted inside each fold only, the frozen final split never
fitted on, and the fit itself recovering known efficiencies."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from predictors.datasets import fleet
from predictors.devices import get_device
from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec
from predictors.spec.precision import get_precision
from predictors.time import evaluate
from predictors.time.efficiency import for_precision
from predictors.time.efficiency_fit import EfficiencyFit


class RecordingFitter:
    """Stands in for EfficiencyFit: remembers which rows each fit saw, and refuses to price a
    row with a fit that saw it."""

    calls: list[frozenset] = []

    def __init__(self, rows) -> None:
        self.rows = rows

    def fit(self, index):
        seen = frozenset(self.rows[i].name for i in index)
        RecordingFitter.calls.append(seen)
        return {"seen": seen}

    def predict(self, efficiency, index):
        for i in index:
            # {}: the roofline's defaults, nothing fitted
            assert self.rows[i].name not in efficiency.get("seen", ()), "a held-out row reached the fit"
        return [1.0 for _ in index]


def _row(name, model, group, gpus=8, use="develop"):
    return SimpleNamespace(name=name, model=model, fit_group=group, seconds=1.0, gpus=gpus,
                           use=use, source="x.csv")  # fmt: skip


ROWS = [_row("a1", "a", "h100/torchtitan"), _row("a2", "a", "h100/torchtitan", 64),
        _row("b1", "b", "h100/torchtitan"), _row("c1", "c", "a100/megatron", 64),
        _row("c2", "c", "a100/megatron"), _row("d1", "d", "a100/megatron", 64)]  # fmt: skip


def test_held_out_group_never_reaches_the_fitter():
    RecordingFitter.calls = []
    folds = evaluate.FleetFolds(ROWS, RecordingFitter)
    res = folds.leave_group_out("new_model", [r.model for r in ROWS])
    assert sorted(n for n, _, _ in res.rows) == sorted(r.name for r in ROWS)
    # model "a" held out: its fit group's fitter saw only "b1"
    assert frozenset({"b1"}) in RecordingFitter.calls
    assert all(not ({"a1", "a2"} <= seen) for seen in RecordingFitter.calls if "b1" in seen)
    by_gpus = folds.leave_group_out("new_gpus", [str(r.gpus) for r in ROWS])
    assert set(by_gpus.per_group) == {"8", "64"}


def test_final_split_is_never_fitted_on(monkeypatch):
    RecordingFitter.calls = []
    final = [_row("f1", "a", "h100/torchtitan", 512, "final")]
    monkeypatch.setattr(fleet, "load_fleet",
                        lambda use=None: [r for r in ROWS + final if use in (None, r.use)])
    res = evaluate.evaluate_fleet_final(RecordingFitter)
    assert [n for n, _, _ in res.rows] == ["f1"]
    assert all("f1" not in seen for seen in RecordingFitter.calls)


def test_pair_error_from_held_out_predictions(monkeypatch):
    a = SimpleNamespace(name="bf", seconds=2.0, precision="bf16-mixed")
    b = SimpleNamespace(name="f8", seconds=1.0, precision="fp8")
    res = evaluate.FleetResult("x", 0.0, {}, [("bf", 3.0, 2.0), ("f8", 2.0, 1.0)])
    monkeypatch.setattr(fleet, "precision_pairs", lambda rows: [(a, b)])
    # predicted ratio 1.5 vs measured 2.0: 25 %
    assert evaluate.pair_error(res, [a, b]).mape == pytest.approx(25.0)


# large enough that its GEMMs and attention are compute-bound on an H100
SPEC = TransformerSpec("llama", 2, 4096, 32, 4096, 32000, num_query_groups=8, swiglu=True,
                       tied_embeddings=False)  # fmt: skip


def test_fit_recovers_known_efficiencies():
    truth = {"gemm_latency": 0.0, "launch_overhead": 20e-6, "matmul:bf16": 0.3981,
             "attention:bf16": 0.2512, "memory": 1.0}
    # sequence lengths apart: attention grows with s^2, the GEMMs with s, so the two separate
    rows = [SimpleNamespace(spec=replace(SPEC, seq_length=seq),
                            strategy=ParallelStrategy(dp, 1, 1, mb, dp * mb * 2),
                            precision="bf16-mixed", device="h100-80gb",
                            options=TrainingOptions(framework="torchtitan"), seconds=1.0)
            for seq, dp, mb in ((1024, 1, 1), (4096, 2, 2), (16384, 8, 1))]  # fmt: skip
    fit = EfficiencyFit(rows)
    for r, t in zip(rows, fit.predict(truth, range(len(rows))), strict=True):
        r.seconds = t
    # one framework: no framework factors (they could not be told from the family's values)
    assert fit.fit(range(len(rows))) == pytest.approx(truth)


def test_framework_factors_are_normalised_to_the_typical_framework_at_the_same_prices():
    from predictors.time.efficiency_fit import _normalised

    rows = [SimpleNamespace(spec=replace(SPEC, seq_length=seq),
                            strategy=ParallelStrategy(1, 1, 1, 1, 1), precision=p, device="h100-80gb",
                            options=TrainingOptions(framework=fw), seconds=1.0)
            for seq, p, fw in ((1024, "bf16-mixed", "torchtitan"), (4096, "fp8", "megatron"),
                               (2048, "fp8", "llm-foundry"), (1024, "bf16-mixed", "megatron"))]  # fmt: skip
    fit = EfficiencyFit(rows)
    index = range(len(rows))
    assert fit.frameworks_of(index, "gemm") == ["llm-foundry", "megatron", "torchtitan"]
    assert fit.frameworks_of(index, "fp8") == ["llm-foundry", "megatron"]
    raw = {"matmul:bf16": 0.5, "attention:bf16": 0.3, "matmul:fp8": 0.4, "memory": 0.8,
           "framework:torchtitan:gemm": 0.6, "framework:megatron:gemm": 1.5,
           "framework:llm-foundry:gemm": 0.9, "framework:torchtitan:fusion": 2.0,
           "framework:megatron:fusion": 0.5, "framework:llm-foundry:fusion": 1.0,
           "framework:megatron:fp8": 1.2, "framework:llm-foundry:fp8": 0.7}  # fmt: skip
    norm = _normalised(raw, {x: fit.frameworks_of(index, x) for x in ("gemm", "fusion", "fp8")})
    for factor, names in (("gemm", ("torchtitan", "megatron", "llm-foundry")),
                          ("fusion", ("torchtitan", "megatron", "llm-foundry")),
                          ("fp8", ("megatron", "llm-foundry"))):  # fmt: skip
        product = 1.0
        for f in names:
            product *= norm[f"framework:{f}:{factor}"]
        assert product == pytest.approx(1.0, rel=1e-3)
    assert fit.predict(norm, index) == pytest.approx(fit.predict(raw, index), rel=1e-3)
    # a framework without a fit of its own is the typical one: factors 1
    typical = fit.predict({k: v for k, v in norm.items() if "megatron" not in k}, [3])
    assert typical != pytest.approx(fit.predict(norm, [3]), rel=1e-3)
    plain = EfficiencyFit([SimpleNamespace(**{**vars(rows[3]),
                                              "options": TrainingOptions(framework="pytorch")})])
    assert plain.predict(norm, [0]) == pytest.approx(typical)


def test_an_fp8_recipe_prices_at_its_own_fitted_efficiency():
    dev = replace(get_device("h100-80gb"), efficiency={"matmul:fp8-rowwise": 0.3})
    assert for_precision(dev, get_precision("fp8-rowwise")).efficiency["matmul:fp8"] == 0.3
    assert "matmul:fp8" not in for_precision(dev, get_precision("fp8")).efficiency


def test_the_kits_fp8_step_is_priced_as_it_runs_and_te_frameworks_are_unchanged():
    from predictors.time.efficiency import EMULATION_HOST_KEY
    from predictors.time.features import step_work
    from predictors.time.trace import FP8_TRANSPOSE

    s, p, dev = ParallelStrategy(1, 1, 1, 2, 2), get_precision("fp8"), get_device("h100-80gb")

    def work(framework):
        return step_work(SPEC, s, p, dev, TrainingOptions(framework=framework)).fwd_bwd.records

    kit, te = work("pytorch"), work("llm-foundry")
    # eager .t().contiguous() copies in the kit's step; TE writes them inside the cast
    assert any(r.name == FP8_TRANSPOSE and r.op_class == "copy" for r in kit)
    assert not any(r.name == FP8_TRANSPOSE for r in te)
    # the kit runs every linear in fp8, the LM head too: more fp8 GEMMs than TE's layers only
    fp8_gemms = [sum(r.name == "_scaled_mm" for r in rs) for rs in (kit, te)]
    assert fp8_gemms[0] > fp8_gemms[1] > 0
    # the Python emulation's host cost applies to the kit's fp8 step only
    host = replace(dev, efficiency={EMULATION_HOST_KEY: 2.0})
    assert for_precision(host, p, "pytorch").launch_overhead == 2 * dev.launch_overhead
    assert for_precision(host, p, "llm-foundry").launch_overhead == dev.launch_overhead
    assert for_precision(host, get_precision("bf16-mixed"), "pytorch").launch_overhead == \
        dev.launch_overhead
    # the kit's delayed and current scaling call one _scaled_mm: one GEMM efficiency
    current = replace(dev, efficiency={"matmul:fp8": 0.4, "matmul:fp8-current": 0.7})
    fp8_current = get_precision("fp8-current")
    assert for_precision(current, fp8_current, "pytorch").efficiency["matmul:fp8"] == 0.4
    assert for_precision(current, fp8_current, "torchtitan").efficiency["matmul:fp8"] == 0.7


def test_unknown_framework_names_the_field():
    with pytest.raises(ValueError, match="framework='colossalai'"):
        TrainingOptions(framework="colossalai")


def test_held_out_framework_is_priced_by_its_device_family_fitted_on_the_others():
    RecordingFitter.calls = []
    rows = ROWS + [_row("e1", "e", "h100/llm-foundry"), _row("e2", "e", "h100/llm-foundry", 64)]
    folds = evaluate.FleetFolds(rows, RecordingFitter)
    res = folds.leave_group_out("new_framework", [r.fit_group.split("/")[1] for r in rows])
    assert sorted(n for n, _, _ in res.rows) == sorted(r.name for r in rows)
    # torchtitan held out: its H100 rows priced with the family fitted on LLM Foundry's only
    assert res.efficiencies["torchtitan"]["h100"]["seen"] == {"e1", "e2"}
    # Megatron held out: no other framework on A100, an empty fit (the roofline's defaults)
    assert res.efficiencies["megatron"]["a100"]["seen"] == frozenset()
    assert res.efficiencies["llm-foundry"]["h100"]["seen"] == {"a1", "a2", "b1"}


def test_a_framework_without_its_own_factors_is_priced_as_the_typical_one():
    from predictors.time.efficiency import with_efficiency

    fitted = {"h100": {"matmul:bf16": 0.5, "framework:torchtitan:gemm": 0.8,
                       "framework:torchtitan:fusion": 1.5}}  # fmt: skip
    h100 = get_device("h100-80gb")
    own, ok = with_efficiency(h100, TrainingOptions(framework="torchtitan"), fitted)
    assert ok and own.efficiency == {"matmul:bf16": 0.5, "framework:gemm": 0.8,
                                     "framework:fusion": 1.5}  # fmt: skip
    family, ok = with_efficiency(h100, TrainingOptions(framework="megatron"), fitted)
    assert ok and family.efficiency == {"matmul:bf16": 0.5}
    none, ok = with_efficiency(get_device("a100-80gb"), TrainingOptions(), fitted)
    assert not ok and none == get_device("a100-80gb")


def test_megatron_h100_table_is_a_development_fleet_file():
    rows = [r for r in fleet.load_fleet("develop") if r.source == fleet.MEGATRON_CSV]
    assert len(rows) == 9 and {r.fit_group for r in rows} == {"h100/megatron"}
    assert {r.precision for r in rows} == {"bf16-mixed"}


def test_no_split_of_the_real_development_rows_fits_on_its_held_out_rows():
    """Every development split over the real rows (the GPU kit's H200 steps included): each
    held-out row is priced by fits that never saw it (RecordingFitter refuses otherwise), and
    the H200 rows are one framework's group of their own."""
    rows = fleet.load_fleet("develop")
    h200 = {r.name for r in rows if r.source == fleet.H200_STEP_CSV}
    assert len(h200) == 40
    RecordingFitter.calls = []
    folds = evaluate.FleetFolds(rows, RecordingFitter)
    for name, groups in (("new_model", [r.model for r in rows]),
                         ("new_gpus", [str(r.gpus) for r in rows]),
                         ("new_framework", [r.fit_group.split("/")[1] for r in rows])):
        res = folds.leave_group_out(name, groups)
        assert {n for n, _, _ in res.rows} == {r.name for r in rows}
    # the framework split holds every H200 step out at once (group "pytorch")
    assert "pytorch" in res.per_group and len(res.per_group) == 4


def test_context_parallel_rows_are_scored_from_the_held_out_predictions():
    RecordingFitter.calls = []
    res = evaluate.evaluate_fleet(RecordingFitter)
    cp = {r.name for r in fleet.load_fleet("develop") if r.strategy.cp > 1}
    assert len(cp) == 6  # torchtitan's 8B and 405B at CP 2, 4, 8
    assert {n for n, _, _ in res["context_parallel"].rows} == cp
    held_out = {n: p for n, p, _ in res["new_model"].rows}
    assert all(held_out[n] == p for n, p, _ in res["context_parallel"].rows)
