"""The kit's result schema, row writer, device comparison and carry unpacking (no GPU, fast)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpucheck.carry import CarryError, unpack_debs  # noqa: E402
from gpucheck.common import PROVENANCE_COLUMNS, RowWriter  # noqa: E402
from gpucheck.parts.device import compare  # noqa: E402
from gpucheck.schema import ALL_FILES, FILES, MAX_FILES, columns, validate_csv, validate_run  # noqa: E402

PROV = {"gpu": "NVIDIA H200", "driver": "580.159.03", "cuda": "13.0", "torch": "2.11.0",
        "date": "2026-12-03T00:00:00Z", "git_commit": "abc"}


def _kvio_row(**kw):
    row = {"test": "engine", "path": "gpu->host_pool", "bytes": 1 << 30, "seconds": 0.1,
           "gbps": 10.7, "byte_exact": True, "repeats": 1, "status": "ok"}
    row.update(kw)
    return row


def test_the_run_fits_what_the_device_tool_returns():
    assert len(ALL_FILES) <= MAX_FILES
    for name in FILES:
        assert set(PROVENANCE_COLUMNS) <= set(columns(name)), name


def test_writer_fills_provenance_and_rejects_unknown_columns_and_status(tmp_path):
    w = RowWriter(tmp_path / "kvio.csv", columns("kvio.csv"), PROV)
    w.write(**_kvio_row(detail={"a": 1}))
    with pytest.raises(ValueError, match="unknown column"):
        w.write(**_kvio_row(speed=3))
    with pytest.raises(ValueError, match="status='fine'"):
        w.write(**_kvio_row(status="fine"))
    w.close()
    rows = list(csv.DictReader(open(tmp_path / "kvio.csv")))
    assert len(rows) == 1 and rows[0]["gpu"] == "NVIDIA H200" and rows[0]["byte_exact"] == "true"
    assert json.loads(rows[0]["detail"]) == {"a": 1}
    assert validate_csv(tmp_path / "kvio.csv") == []


@pytest.mark.parametrize("edit, message", [
    ({"gbps": "fast"}, "gbps='fast' is not a float"),
    ({"seconds": ""}, "seconds is empty on an ok row"),
    ({"status": "skipped", "note": ""}, "must say why in note"),
    ({"gpu": ""}, "provenance column gpu is empty"),
    ({"byte_exact": "yes"}, "byte_exact='yes' is not a bool"),
])
def test_validation_names_the_broken_field(tmp_path, edit, message):
    path = tmp_path / "kvio.csv"
    w = RowWriter(path, columns("kvio.csv"), PROV)
    w.write(**_kvio_row())
    w.close()
    rows = list(csv.DictReader(open(path)))
    rows[0].update(edit)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns("kvio.csv"))
        writer.writeheader()
        writer.writerows(rows)
    errors = validate_csv(path)
    assert any(message in e for e in errors), errors


def test_validate_run_flags_missing_run_json_and_stray_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    errors = validate_run(tmp_path)
    assert any("run.json missing" in e for e in errors)
    assert any("unexpected files ['notes.txt']" in e for e in errors)


H200_NVML = {"name": "NVIDIA H200", "driver": "580.159.03", "count": 1,
             "memory_total": 143771 * 2**20, "max_mem_clock_mhz": 3201,
             "mem_bus_width_bits": 6144, "max_sm_clock_mhz": 1980}
H200_PROPS = {"sm_count": 132, "major": 9, "minor": 0}


def test_device_comparison_on_the_h200_numbers_seen_on_the_lent_machine():
    from predictors.devices import DEVICES, match_gpu_name

    detected = match_gpu_name(H200_NVML["name"], H200_NVML["memory_total"], 1)
    rows = {r["field"]: r for r in compare(H200_NVML, H200_PROPS, detected, "h200",
                                            DEVICES["h200"])}
    assert rows["name"]["match"] and rows["name"]["table_key"] == "h200"
    assert rows["memory_bytes"]["match"]  # 143771 MiB vs the table's 141 GiB: within 2 %
    assert rows["devices_per_node"]["match"]  # detection keeps NVML's count (1), not 8
    assert rows["mem_bw"]["match"]  # 2 x 3201 MHz x 768 B = 4.92 TB/s vs 4.8 TB/s
    assert rows["peak_flops_bf16"]["match"]  # 132 SMs x 1.98 GHz x 4096 vs 989 TFLOP/s
    assert rows["supports_fp8"]["match"]


def test_device_comparison_reports_a_wrong_table_entry():
    from predictors.devices import DEVICES

    a100 = DEVICES["a100-80gb"]
    detected = SimpleNamespace(name="a100-80gb", memory_bytes=a100.memory_bytes,
                               devices_per_node=1, mem_bw=a100.mem_bw,
                               peak_flops=a100.peak_flops, supports_fp8=False)
    rows = {r["field"]: r for r in compare(H200_NVML, H200_PROPS, detected, "a100-80gb", a100)}
    assert rows["mem_bw"]["match"] is False
    assert rows["peak_flops_bf16"]["match"] is False
    assert rows["supports_fp8"]["match"] is False


def test_unpack_debs_names_what_is_missing(tmp_path):
    (tmp_path / "debs").mkdir()
    with pytest.raises(CarryError, match="no liburing-dev .deb"):
        unpack_debs(tmp_path, tmp_path / "prefix")


def test_a_part_past_its_limit_is_killed_and_recorded(tmp_path):
    import os

    from gpucheck.common import PartContext
    from gpucheck.harness import _run_part

    ctx = PartContext(name="megatron", out=str(tmp_path), dry_run=True, device="cpu",
                      budget_s=1.0, provenance=PROV, workdir=str(tmp_path))
    ctx.save(tmp_path / "ctx.json")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(tmp_path / "log.txt", "w") as log:
        res = _run_part(ctx, tmp_path / "ctx.json", env, timeout=1.0, log=log)
    assert res["status"] == "timeout" and "killed at its 1 s limit" in res["error"]
    assert res["seconds"] < 30  # the whole process group went, not just the shell


def test_predictions_from_worker_processes_join_their_rows_in_grid_order(tmp_path):
    from gpucheck.common import Budget
    from gpucheck.predictions import Predictions

    w = RowWriter(tmp_path / "kvio.csv", columns("kvio.csv"), PROV)
    # dict(pairs) stands in for a predictor: any picklable callable returning the columns
    preds = Predictions(dict, lambda row, pred: {**row, **pred}, w, parallel=True)
    try:
        assert preds.pool is not None
        for i in range(3):
            preds.submit(i, [("repeats", i)])
        for i in range(3):
            preds.measured(i, _kvio_row(path=f"leg{i}"))
        preds.drain(Budget(60))
    finally:
        preds.close()
        w.close()
    rows = list(csv.DictReader(open(tmp_path / "kvio.csv")))
    assert [(r["path"], r["repeats"]) for r in rows] == [("leg0", "0"), ("leg1", "1"),
                                                         ("leg2", "2")]


def test_memory_grid_has_the_llava_tower_at_two_batch_sizes_in_bf16():
    """Issue 45 item 5: the LLaVA-style tower (ViT + projector + small LLM) in bf16 autocast at
    two batch sizes, each its own ground-truth row (the fold keys rows by their config), so a
    run with GPUCHECK_MEMORY_EVENTS=1 records both event streams."""
    from gpucheck import adapters
    from gpucheck.parts import memory

    tower = [p for p in memory.grid(tiny=False) if (p.family, p.precision, p.optimizer,
                                                    p.checkpointing) == ("llava", "bf16",
                                                                         "foreach", "none")]
    pairs = [memory._preset(p) for p in tower]
    assert sorted(cfg.batch for _, cfg in pairs) == [4, 8]
    assert pairs[0][0].multimodal and pairs[0][0] == pairs[1][0]  # the same tower
    keys = {adapters.memory_row_fields(spec, cfg)["key"] for spec, cfg in pairs}
    assert len(keys) == 2
