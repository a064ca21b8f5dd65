"""predict_iteration_time: named errors, sane structure, and the CPU model held out."""

import json
from pathlib import Path

import numpy as np
import pytest

from predictors import predict_iteration_time
from predictors.devices import UnknownDeviceError, UnsupportedPrecisionError, get_device
from predictors.precision import UnknownPrecisionError
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec
from predictors.time_predictor import predict

GPT = TransformerSpec("gpt", 24, 2048, 16, 1024, 50257)
# Stated accuracy of the CPU model held out by family and by size on the shipped measurements
# (benchmarks/bench_time_predictor.py measures 15.93%; the 5% goal is NOT met).
CPU_HELDOUT_MAPE = 18.0
# Stated accuracy of a model trained in the test on a small set collected in the test
# (interleaved rounds; measured 8.4-12.8% mean of by-family/by-size over 4 runs, one over 15%;
# the 5% goal is NOT met).
FRESH_HELDOUT_MAPE = 17.0


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


@pytest.mark.slow
def test_cpu_model_heldout_by_family_and_size_on_shipped_measurements():
    """Leave-one-family-out and leave-one-size-out on the shipped CPU measurements: the stated
    MAPE holds and the precision-unaware ablation is far worse."""
    from predictors.collect import device_profile_path, features_cache_path, load_measurements
    from predictors.devices import Device
    from predictors.evaluate import evaluate_measurements
    from predictors.vtrain import data_path

    shipped = data_path("cpu_measurements.csv")
    device = Device.from_dict(json.loads(device_profile_path(shipped).read_text()))
    res = evaluate_measurements(load_measurements(shipped), device,
                                cache=features_cache_path(shipped))  # fmt: skip
    aware = (res["by_family"].mape + res["by_size"].mape) / 2
    unaware = (res["by_family_unaware"].mape + res["by_size_unaware"].mape) / 2
    print(f"\nCPU held-out MAPE on shipped data: aware {aware:.2f}%, unaware {unaware:.2f}%")
    assert aware <= CPU_HELDOUT_MAPE
    assert unaware > 3 * aware


@pytest.mark.slow
def test_cpu_model_trained_on_fresh_measurements_heldout(tmp_path):
    """Collect a small grid on this machine now (5 families x 2 sizes x 6 precisions x 2
    micro-batches, interleaved rounds), train, and hold out by family and by size: the stated
    MAPE holds and the precision-unaware ablation is far worse."""
    from predictors.collect import (
        collect_interleaved,
        default_grid,
        device_profile_path,
        load_measurements,
    )
    from predictors.devices import Device
    from predictors.evaluate import evaluate_measurements

    models = [f"{f}-{s}" for f in ("gpt", "llama", "bert", "vit", "convnet") for s in ("s", "m")]
    precisions = ("fp32", "bf16", "bf16-pure", "bf16-mixed", "fp16-mixed", "fp16-pure")
    points = default_grid(precisions, seqs=(32,), batches=(1, 4), models=models, dp_sizes=(1,))
    data = collect_interleaved(tmp_path / "fresh.csv", points, rounds=5, progress=False)
    device = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    res = evaluate_measurements(load_measurements(data), device)
    aware = (res["by_family"].mape + res["by_size"].mape) / 2
    unaware = (res["by_family_unaware"].mape + res["by_size_unaware"].mape) / 2
    print(f"\nCPU held-out MAPE on fresh data: aware {aware:.2f}%, unaware {unaware:.2f}%")
    assert aware <= FRESH_HELDOUT_MAPE, (aware, unaware)
    assert unaware > 2.5 * aware, (aware, unaware)
