"""``python -m gpucheck.fold``: a GPU run's rows land in the predictors' data sets in the
format their loaders read, with the run's provenance; a dry run is refused. (The rows here are
made on the CPU and marked as GPU rows: this checks the plumbing, not a measurement.)"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gpucheck.common import RowWriter  # noqa: E402
from gpucheck.fold import main as fold  # noqa: E402
from gpucheck.parts import memory, timing  # noqa: E402
from gpucheck.schema import columns  # noqa: E402

PROV = {"gpu": "NVIDIA H200", "driver": "580.159.03", "cuda": "13.0", "torch": "2.11.0+cu130",
        "date": "2026-12-03T16:00:00Z", "git_commit": "f77cc8e"}


def _results(tmp_path: Path, dry_run: bool) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    point = next(p for p in memory.grid(True) if p.family == "llm")
    row = memory.measure(point, "cpu")
    row.update(status="ok", note="", peak_allocated=123 * 2**20, peak_reserved=160 * 2**20)
    w = RowWriter(out / "memory.csv", columns("memory.csv"), PROV)
    w.write(**row)
    w.close()
    trow = timing.measure_point(*timing.DRY_CONFIGS[0], "fp32", "cpu", True)
    trow.pop("_spec")
    trow.update(canary_ms=1.0, canary_ratio=1.0, status="ok")
    w = RowWriter(out / "time.csv", columns("time.csv"), PROV)
    w.write(**trow)
    w.close()
    run = {"dry_run": dry_run, "provenance": PROV, "seconds": 1.0,
           "parts": {"device": {"status": "ok", "summary": {"nvml": {
               "name": "NVIDIA H200", "memory_total": 143771 * 2**20}}}}}
    (out / "run.json").write_text(json.dumps(run))
    return out


@pytest.mark.slow
def test_fold_appends_memory_rows_and_writes_time_rows_with_provenance(tmp_path):
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.memory.evaluate import load_rows
    from predictors.time.collect import device_profile_path

    results = _results(tmp_path, dry_run=False)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "predictors/data/memory_ground_truth.csv", data)
    before = len(load_rows(data / "memory_ground_truth.csv"))
    assert fold([str(results), "--data-dir", str(data)]) == 0
    rows = load_rows(data / "memory_ground_truth.csv")
    assert len(rows) == before + 1
    assert rows[-1].measured == 160 * 2**20 and "NVIDIA H200, driver 580.159.03" in \
        rows[-1].ground_truth
    assert fold([str(results), "--data-dir", str(data)]) == 0  # rerun: nothing doubled
    assert len(load_rows(data / "memory_ground_truth.csv")) == before + 1
    times = data / "time_h200.csv"
    df = load_measurements(times)
    assert len(df) == 1 and df["gpu"][0] == "NVIDIA H200"
    device = Device.from_dict(json.loads(device_profile_path(times).read_text()))
    assert device.family == "h100" and device.memory_bytes == 143771 * 2**20


def test_fold_refuses_a_dry_run(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"dry_run": True, "provenance": PROV}))
    assert fold([str(out), "--data-dir", str(tmp_path)]) == 2
    assert "holds a dry run" in capsys.readouterr().err


@pytest.mark.slow
def test_fold_one_part_with_the_sent_commit(tmp_path, capsys):
    from predictors.datasets.measurements import load_measurements

    results = _results(tmp_path, dry_run=False)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "predictors/data/memory_ground_truth.csv", data)
    memory_before = (data / "memory_ground_truth.csv").read_bytes()
    assert fold([str(results), "--data-dir", str(data), "--parts", "time",
                 "--commit", "677202e"]) == 0
    assert (data / "memory_ground_truth.csv").read_bytes() == memory_before
    df = load_measurements(data / "time_h200.csv")
    assert df["git_commit"][0] == "677202e (sent; the run reported f77cc8e)"
    assert fold([str(results), "--data-dir", str(data), "--commit", "not-a-sha"]) == 2
    assert fold([str(results), "--data-dir", str(data), "--parts", "kvio"]) == 2
    assert "commit='not-a-sha'" in capsys.readouterr().err


def test_fold_writes_timed_megatron_steps_the_fleet_loader_reads(tmp_path):
    """#44 item 4: the megatron part's timed_step rows become framework-megatron development
    rows of the time predictor's fleet (the TP 2 row skipped on a one-GPU machine is not)."""
    from predictors.datasets.fleet import load_megatron_steps
    from predictors.time.efficiency_fit import EfficiencyFit

    out = tmp_path / "results"
    out.mkdir()
    spec = {"attention": "unfused", "family": "llama", "ffn_hidden_size": None,
            "hidden_size": 64, "num_attention_heads": 4, "num_layers": 2,
            "num_query_groups": None, "seq_length": 32, "swiglu": True,
            "tied_embeddings": False, "vocab_size": 128}  # fmt: skip
    w = RowWriter(out / "megatron.csv", columns("megatron.csv"), PROV)
    w.write(event="init", strategy="dp1tp1pp1mb2gb8", seconds=1.0, backend="nccl", status="ok")
    w.write(event="timed_step", strategy="dp1tp1pp1mb2gb8", iteration=6, loss=9.5,
            seconds=0.0123, backend="nccl", precision="bf16-mixed", status="ok",
            detail={"spec": spec, "framework": "megatron", "ranks": 1, "median_s": 0.0125,
                    "min_s": 0.0121, "times": [0.0121] * 6, "pred_seconds": 0.011})  # fmt: skip
    w.write(event="timed_step", strategy="dp1tp2pp1mb2gb8", seconds=0, backend="nccl",
            precision="bf16-mixed", status="skipped", detail={"spec": spec, "ranks": 2})
    w.close()
    (out / "run.json").write_text(json.dumps({"dry_run": False, "provenance": PROV}))
    data = tmp_path / "data"
    data.mkdir()
    assert fold([str(out), "--data-dir", str(data), "--parts", "megatron"]) == 0
    assert fold([str(out), "--data-dir", str(data), "--parts", "megatron"]) == 0  # no double
    rows = load_megatron_steps(data)
    assert len(rows) == 1
    r = rows[0]
    assert (r.options.framework, r.device, r.strategy.name, r.precision, r.seconds) == (
        "megatron", "h200", "dp1tp1pp1mb2gb8", "bf16-mixed", 0.0123)
    assert r.spec.attention == "unfused" and r.spec.swiglu and r.model == "mcore-llama-h64-l2"
    assert EfficiencyFit(rows).predict({}, [0])[0] > 0  # priced like any fleet row
