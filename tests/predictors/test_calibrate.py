"""The roofline's non-datasheet constants are fitted on the rows given, and only those."""

from dataclasses import replace

import pytest

from predictors.datasets.vtrain import load_vtrain
from predictors.devices import get_device
from predictors.spec.precision import get_precision
from predictors.time.analytical import iteration_time
from predictors.time.calibrate import fit_gpu_constants, with_constants
from predictors.time.features import step_work


def test_fit_recovers_the_constants_rows_were_made_with():
    """Rows whose 'measured' time is the roofline at known constants (times a constant
    offset the correction would absorb) give back exactly those constants. vTrain's rows run
    on one node: their collectives cost NCCL's NVLink latency, so the latency of a step
    across nodes is not fitted on them (the device keeps its own)."""
    base = get_device("a100-80gb")
    truth = {"launch_overhead": 60e-6, "gemm_latency": 10e-6}
    dev = replace(base, comm_latency=5e-6, **truth)
    p = get_precision("fp16-mixed")
    rows = [r for r in load_vtrain() if r.spec.num_layers == 12][::6]
    assert all(r.strategy.world_size <= 8 for r in rows)
    made = [replace(r, seconds=1.3 * iteration_time(step_work(r.spec, r.strategy, p, dev),
                                                    r.strategy, dev).total) for r in rows]  # fmt: skip
    assert fit_gpu_constants(made, "fp16-mixed", base) == truth


def test_cpu_fit_recovers_the_per_kernel_cost_despite_per_precision_offsets():
    """CPU rows 'measured' as the roofline at a known per-kernel cost, each precision with its
    own constant offset (which the correction learns from the precision features), give that
    cost back: the spread is taken around each precision's own median."""
    import json

    from predictors.datasets import data_path
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.time.calibrate import fit_cpu_constants
    from predictors.time.collect import device_profile_path, row_spec_strategy

    data = data_path("cpu_measurements.csv")
    profile = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    df = load_measurements(data)
    df = df[(df["model"].isin(["gpt-xs", "convnet-xs"])) & (df["dp"] == 1)
            & df["precision"].isin(["fp32", "bf16"])].copy()  # fmt: skip
    truth = replace(profile, launch_overhead=20e-6)
    offset = {"fp32": 1.0, "bf16": 1.7}
    made = []
    for _, r in df.iterrows():
        spec, st = row_spec_strategy(r)
        w = step_work(spec, st, get_precision(r["precision"]), truth)
        made.append(offset[r["precision"]] * iteration_time(w, st, truth).total)
    df["seconds"] = made
    assert fit_cpu_constants(df, profile) == {"launch_overhead": 20e-6}


def test_with_constants_names_a_bad_field():
    dev = get_device("a100-80gb")
    assert with_constants(dev, None) is dev
    assert with_constants(dev, {"gemm_latency": 5e-6}).gemm_latency == 5e-6
    with pytest.raises(ValueError, match="bogus"):
        with_constants(dev, {"bogus": 1.0})
    with pytest.raises(ValueError, match="rows is empty"):
        fit_gpu_constants([], "fp16-mixed", dev)
