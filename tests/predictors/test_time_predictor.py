"""predict_iteration_time: named errors, sane structure, and the CPU model held out."""

import json
from pathlib import Path

import numpy as np
import pytest

from predictors import predict_iteration_time
from predictors.devices import UnknownDeviceError, UnsupportedPrecisionError, get_device
from predictors.spec import ParallelStrategy, StrategyError, TrainingOptions, TransformerSpec
from predictors.spec.precision import UnknownPrecisionError
from predictors.time.predictor import predict

GPT = TransformerSpec("gpt", 24, 2048, 16, 1024, 50257)


def test_named_errors():
    s = ParallelStrategy(2, 2, 2, 1, 8)
    with pytest.raises(UnknownPrecisionError, match="precision='fp4'"):
        predict_iteration_time(GPT, s, "fp4", "a100-80gb")
    with pytest.raises(UnknownDeviceError, match="device='tpu-v9'"):
        predict_iteration_time(GPT, s, "bf16", "tpu-v9")
    with pytest.raises(StrategyError, match="tp=3 does not divide num_attention_heads=16"):
        predict_iteration_time(GPT, ParallelStrategy(1, 3, 1), "bf16", "a100-80gb")
    with pytest.raises(StrategyError, match="pp=5 does not divide num_layers=24"):
        predict_iteration_time(GPT, ParallelStrategy(1, 1, 5), "bf16", "a100-80gb")
    with pytest.raises(UnsupportedPrecisionError, match="a100-80gb"):
        predict_iteration_time(GPT, s, "fp8", "a100-80gb")
    assert predict_iteration_time(GPT, s, "fp8", "h100-80gb") > 0


def test_a100_structure():
    s = ParallelStrategy(4, 2, 1, 2, 64)
    t16 = predict_iteration_time(GPT, s, "fp16-mixed", "a100-80gb")
    t32 = predict_iteration_time(GPT, s, "fp32", "a100-80gb")
    deeper = TransformerSpec("gpt", 48, 2048, 16, 1024, 50257)
    assert predict_iteration_time(deeper, s, "fp16-mixed", "a100-80gb") > 1.5 * t16
    assert t32 > 2 * t16  # fp32 has no tensor cores on A100
    assert predict_iteration_time(GPT, s.with_batch(2, 128), "fp16-mixed", "a100-80gb") > 1.6 * t16
    # the pipeline bubble shrinks with more micro-batches: (pp-1)/m
    few = predict(GPT, ParallelStrategy(1, 2, 4, 1, 4), "bf16", "a100-80gb").breakdown
    many = predict(GPT, ParallelStrategy(1, 2, 4, 1, 32), "bf16", "a100-80gb").breakdown
    assert few.bubble == pytest.approx(3 * few.compute_mb + 3 * few.tp_comm_mb + 3 * few.pp_p2p_mb)
    assert few.bubble / few.total > 3 * many.bubble / many.total
    tp8 = predict(GPT, ParallelStrategy(1, 8, 1, 1, 8), "bf16", "a100-80gb").breakdown
    assert tp8.tp_comm_mb > 0 and tp8.dp_comm == 0


def test_calibrated_on_vtrain():
    res = predict(GPT, ParallelStrategy(2, 2, 2, 2, 32), "fp16-mixed", "a100-80gb")
    assert res.calibrated and res.model_file.endswith("time_a100.json")
    meta = json.loads(Path(res.model_file).read_text())
    assert "ground_truth_single.csv" in meta["training_data"]
    # one precision in the training data: no precision features in the correction
    assert not {"fp8", "matmul_flops_fp16", "param_bits"} & set(meta["feature_names"])
    # a device without its own correction gets the roofline, not the A100's efficiency
    h100 = predict(GPT, ParallelStrategy(2, 2, 2, 2, 32), "bf16-mixed", "h100-80gb")
    assert not h100.calibrated and h100.seconds == h100.analytical_seconds


def test_training_api_excludes_rows():
    from predictors.datasets.vtrain import load_vtrain
    from predictors.time.predictor import predict_with_model
    from predictors.time.train import train_vtrain_model

    rows = [r for r in load_vtrain() if r.spec.num_layers == 12]  # 2 sizes, fast to featurise
    held = "h2048-l12"
    model = train_vtrain_model(lambda r: r.size == held, rows=rows)
    assert model.meta["rows"] == sum(r.size != held for r in rows)
    with pytest.raises(ValueError, match="exclude removed every"):
        train_vtrain_model(lambda r: True, rows=rows)
    r = next(r for r in rows if r.size == held)
    assert predict_with_model(model, r.spec, r.strategy, "fp16-mixed", "a100-80gb") > 0


def test_evaluation_folds_and_cona_share_the_one_trainer():
    """A held-out fold of the evaluation and train_vtrain_model (which CONA's
    HeldOutPredictor trains with) fit the same constants and predict the same."""
    from predictors.datasets.vtrain import load_vtrain
    from predictors.time.evaluate import _VTrainFolds
    from predictors.time.predictor import predict_with_model
    from predictors.time.train import train_vtrain_model

    rows = [r for r in load_vtrain() if r.spec.num_layers == 12]
    held = "h1024-l12"
    train = [i for i, r in enumerate(rows) if r.size != held]
    test = [i for i, r in enumerate(rows) if r.size == held]
    pred, constants = _VTrainFolds(rows).fold(train, test)
    model = train_vtrain_model(lambda r: r.size == held, rows=rows)
    assert model.meta["device_constants"] == constants
    direct = [predict_with_model(model, rows[i].spec, rows[i].strategy, "fp16-mixed", "a100-80gb")
              for i in test]  # fmt: skip
    assert direct == pytest.approx(list(pred), rel=1e-9)


def test_public_validation_data_shipped_with_sources():
    """The transcribed public tables load, carry their licences, and agree with themselves
    (Megatron's MFU column is its TFLOP/s column over the H100 bf16 peak)."""
    import csv

    from predictors.datasets import data_path
    from predictors.datasets.fleet import load_llm_foundry_pairs
    from predictors.datasets.public import load_megatron_weak_scaling

    sources = data_path("PUBLIC_SOURCES.md").read_text()
    for name in ("megatron_h100_weak_scaling.csv", "llm_foundry_h100.csv"):
        assert name in sources
    assert "Apache License" in data_path("LICENSE.llm-foundry").read_text()
    assert "NVIDIA CORPORATION" in data_path("LICENSE.megatron-lm").read_text()
    rows = load_megatron_weak_scaling()
    assert [r.strategy.world_size for r in rows] == [48, 96, 192, 384, 768, 1536, 2304, 3072, 6144]
    with open(data_path("megatron_h100_weak_scaling.csv")) as f:
        for r in csv.DictReader(f):
            assert abs(float(r["tflops_per_gpu"]) / 989 * 100 - float(r["mfu_percent"])) < 1.0
    assert all(0.3 < r.seconds < 20 for r in rows)
    pairs = load_llm_foundry_pairs()
    assert len(pairs) == 5 and all(0.9 < p.measured_ratio < 1.5 for p in pairs)


def test_unknown_gpu_name_from_nvml_maps_to_table():
    from predictors.devices import match_gpu_name

    assert match_gpu_name("NVIDIA A100-SXM4-80GB", 80 * 2**30).family == "a100"
    assert match_gpu_name("NVIDIA H100 80GB HBM3", 80 * 2**30).supports_fp8
    assert match_gpu_name("Tesla T4", 16 * 2**30) is None
    assert get_device("cpu").kind == "cpu"


def test_emulated_dtype_rate_never_falls_with_gemm_size():
    """fp16 on a CPU without AVX512-FP16 calibrates slower at the large GEMM than the small one
    (an emulation, or a contention hit): larger GEMMs must not be modelled slower per FLOP."""
    from predictors.devices import LARGE_GEMM_FLOPS, SMALL_GEMM_FLOPS, Device

    cpu = Device("cpu:test", "cpu", "cpu", {"fp32": 100e9, "fp16": 1e9}, 80e9, 10e9, 1e9, 2**34,
                 small_gemm={"fp32": 50e9, "fp16": 5e9})  # fmt: skip
    assert cpu.matmul_rate("fp16", 4 * LARGE_GEMM_FLOPS) == 5e9
    assert cpu.matmul_rate("fp16", SMALL_GEMM_FLOPS) == 5e9
    rates = [cpu.matmul_rate("fp32", f) for f in np.geomspace(SMALL_GEMM_FLOPS, LARGE_GEMM_FLOPS, 5)]
    assert rates == sorted(rates) and rates[0] == 50e9 and rates[-1] == pytest.approx(100e9)


def test_cpu_half_precision_gemm_is_capped_at_twice_fp32_without_amx():
    """Without AMX, a bf16/fp16 GEMM on a CPU core runs at most 2x its fp32 rate (two products
    per 32-bit lane per instruction); a calibration above that is an artefact. With AMX the
    measured rate stands."""
    from predictors.devices import LARGE_GEMM_FLOPS, SMALL_GEMM_FLOPS, Device

    peaks, small = {"fp32": 100e9, "bf16": 430e9}, {"fp32": 90e9, "bf16": 300e9}
    avx = Device("cpu:avx", "cpu", "cpu", peaks, 80e9, 10e9, 1e9, 2**34, small_gemm=small,
                 flags=("avx512_bf16",))  # fmt: skip
    assert avx.matmul_rate("bf16", LARGE_GEMM_FLOPS) == 200e9
    assert avx.matmul_rate("bf16", SMALL_GEMM_FLOPS) == 180e9
    assert avx.matmul_rate("fp32", LARGE_GEMM_FLOPS) == 100e9
    amx = Device("cpu:amx", "cpu", "cpu", peaks, 80e9, 10e9, 1e9, 2**34, small_gemm=small,
                 flags=("amx_bf16", "avx512_bf16"))  # fmt: skip
    assert amx.matmul_rate("bf16", LARGE_GEMM_FLOPS) == 430e9


def test_shipped_features_cache_matches_todays_feature_code():
    """The shipped measurements' features cache is keyed by the code that computes features; a
    stale one is silently recomputed by every run of benchmarks/bench_time_predictor.py (and
    rewritten in the checkout), so a change to that code must ship the regenerated cache."""
    from predictors.datasets import data_path
    from predictors.devices import Device
    from predictors.time.collect import device_profile_path, features_cache_path
    from predictors.time.feature_sets import features_cache_tag

    shipped = data_path("cpu_measurements.csv")
    device = Device.from_dict(json.loads(device_profile_path(shipped).read_text()))
    cache = features_cache_path(shipped)
    assert json.loads(cache.read_text())["tag"] == features_cache_tag(device), (
        f"{cache} is stale: run `python benchmarks/bench_time_predictor.py`, which rewrites "
        "it, and commit it")


@pytest.mark.slow
def test_cpu_held_out_splits_predict_every_row_from_a_fold_of_its_own():
    """Leave-one-family-out, leave-one-size-tier-out (precision-aware and not), leave-one-
    precision-out and unseen sequence length on the shipped CPU measurements: every group is
    held out in turn, with per-kernel costs fitted for its fold, and every row predicted.
    Their accuracy is timing-derived, so it is benchmarks/bench_time_predictor.py's figure
    (issue 44: no accuracy threshold in a unit test)."""
    from predictors.datasets import data_path
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.time.collect import device_profile_path
    from predictors.time.evaluate import evaluate_measurements, size_tier

    shipped = data_path("cpu_measurements.csv")
    device = Device.from_dict(json.loads(device_profile_path(shipped).read_text()))
    full = load_measurements(shipped)
    # every 20th row keeps every family, size tier, precision and sequence length: the same
    # folds in a fifth of the time; no cache, so the shipped one is neither read nor written
    df = full.iloc[::20]
    for column in ("family", "precision", "seq"):
        assert set(df[column]) == set(full[column]), column
    assert {size_tier(m) for m in df["model"]} == {size_tier(m) for m in full["model"]}
    res = evaluate_measurements(df, device)
    groups = {"by_family": set(df["family"]), "by_size": {size_tier(m) for m in df["model"]},
              "by_precision": set(df["precision"])}
    groups |= {f"{k}_unaware": v for k, v in groups.items() if k != "by_precision"}
    for name, held in groups.items():
        r = res[name]
        assert set(r.per_group) == set(r.constants) == held, name
        assert len(r.predicted) == len(df) and (r.predicted > 0).all(), name
    seqs = {int(v) for v in df["seq"] if int(v) > 0}
    assert set(res["by_seq"].per_group) == {f"seq{s}" for s in seqs}


def test_uneven_pipeline_split_is_accepted_and_the_deepest_stage_sets_the_pace():
    """126 layers on pp=8 (Megatron's --decoder-first/last-pipeline-num-layers), which an even
    split rejects: 15 + 6 x 16 + 15 prices each micro-batch at the 16-layer stage (the same
    per-stage work as 128 layers split evenly), a deeper first stage prices more, and an even
    split spelled out layer by layer predicts exactly what the default split does."""
    deep = TransformerSpec("gpt", 126, 2048, 16, 1024, 50257)
    with pytest.raises(StrategyError, match="pp=8 does not divide num_layers=126"):
        predict(deep, ParallelStrategy(1, 1, 8, 1, 16), "bf16", "h200")
    ends = ParallelStrategy(1, 1, 8, 1, 16, first_stage_layers=15, last_stage_layers=15)
    uneven = predict(deep, ends, "bf16", "h200")
    even128 = predict(TransformerSpec("gpt", 128, 2048, 16, 1024, 50257),
                      ParallelStrategy(1, 1, 8, 1, 16), "bf16", "h200")
    assert uneven.seconds > 0
    assert uneven.breakdown.as_dict() == even128.breakdown.as_dict()
    heavy_first = ParallelStrategy(1, 1, 8, 1, 16, first_stage_layers=21)  # 21 + 7 x 15
    assert (predict(deep, heavy_first, "bf16", "h200").breakdown.compute_mb
            > uneven.breakdown.compute_mb)
    spelled = ParallelStrategy(2, 2, 2, 2, 32, first_stage_layers=12)
    assert (predict(GPT, spelled, "bf16", "a100-80gb").seconds
            == predict(GPT, ParallelStrategy(2, 2, 2, 2, 32), "bf16", "a100-80gb").seconds)
    with pytest.raises(StrategyError, match="virtual_pipeline=2 with an uneven pipeline split"):
        predict(deep, ends, "bf16", "h200", options=TrainingOptions(virtual_pipeline=2))
