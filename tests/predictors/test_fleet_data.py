"""The development fleet files: provenance, columns, uses and the conversion to seconds."""

import csv

import pytest

from predictors.datasets import data_path, fleet

LICENCES = {fleet.TORCHTITAN_CSV: ("LICENSE.torchtitan", "BSD 3-Clause"),
            fleet.FOUNDRY_CSV: ("LICENSE.llm-foundry", "Apache License")}  # fmt: skip


def test_every_fleet_file_has_its_source_licence_and_use_documented():
    sources = data_path("PUBLIC_SOURCES.md").read_text()
    for name in fleet.FLEET_FILES:
        assert f"`{name}`" in sources
        assert data_path(name).exists()
    for licence, text in LICENCES.values():
        assert text in data_path(licence).read_text()
        assert licence in sources
    for commit in ("d4c86e3758a84cf23e2e879ab3c995cba9d5e410", "8c8dd48f72", "2104.04473"):
        assert commit in sources
    # the held-out sets stay out of the repository
    assert "NeMo" in sources and not any("nemo" in n.lower() for n in fleet.FLEET_FILES)


@pytest.mark.parametrize("name", [fleet.TORCHTITAN_CSV, fleet.FOUNDRY_CSV])
def test_rows_carry_a_known_use_and_precision(name):
    with open(data_path(name), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["use"] for r in rows} <= set(fleet.USES)
    assert {r["precision"] for r in rows} <= set(fleet.PRECISION_OF)


def test_seconds_from_published_throughput():
    rows = {r.name: r for r in fleet.load_fleet()}
    # torchtitan Table 1: 8B, FSDP 8, local batch 2, seq 8192, 5,762 tokens/s/GPU
    tt = rows["tt1-llama3.1-8b-dp8tp1pp1mb2gb16-bf16-eager-vp1"]
    assert tt.seconds == pytest.approx(16 * 8192 / (5762 * 8))
    # Table 5, interleaved 1F1B: 8 micro-batches of 4, two chunks per rank, async TP
    il = rows["tt5-llama3.1-405b-dp8tp8pp8mb4gb256-float8-compile-asynctp-vp2"]
    assert (il.strategy.num_microbatches, il.options.virtual_pipeline) == (8, 2)
    assert il.options.tp_comm_overlap and il.options.recompute == "full"
    # Table 2, FSDP 1 x CP 8 at 262,144 tokens: FSDP over the CP group
    cp = rows["tt2-llama3.1-8b-dp1tp1pp1cp8mb1gb1-float8-compile-vp1"]
    assert cp.strategy.cp == 8 and cp.options.fsdp and cp.precision == "fp8-current"
    # Narayanan et al. Table 1, 1.7B: 137 TFLOP/s on 32 GPUs, the paper's FLOP count
    nar = rows["narayanan-1.7b"]
    assert nar.seconds == pytest.approx(fleet.narayanan_flops(nar.spec, 512) / (137e12 * 32))
    assert nar.options.recompute == "full" and nar.device == "a100-80gb"


def test_uses_split_the_rows():
    dev, final = fleet.load_fleet("develop"), fleet.load_fleet("final")
    assert len(dev) + len(final) == len(fleet.load_fleet())
    assert {r.name for r in dev}.isdisjoint(r.name for r in final)
    assert {r.device for r in final} == {"h100-80gb", "h200"}
    assert min(r.gpus for r in final if r.device == "h100-80gb") >= 128
    with pytest.raises(fleet.FleetDataError, match="use='test'"):
        fleet.load_fleet("test")


def test_precision_pairs_differ_only_in_precision():
    pairs = fleet.precision_pairs(fleet.load_fleet("develop"))
    # 15 from the published tables, 8 from the H200 steps (4 shapes x fp8, fp8-current)
    assert len([p for p in pairs if p[0].source != fleet.H200_STEP_CSV]) == 15
    assert len(pairs) == 23
    for ref, fast in pairs:
        assert ref.precision == "bf16-mixed" and fast.precision.startswith("fp8")
        assert ref.run_key == fast.run_key


def test_unknown_precision_label_names_the_field(monkeypatch):
    original = fleet._rows

    def bad(name):
        rows = original(name)
        return [{**r, "precision": "fp4"} for r in rows]

    monkeypatch.setattr(fleet, "_rows", bad)
    with pytest.raises(fleet.FleetDataError, match="precision='fp4'"):
        fleet.load_llm_foundry()


def test_h200_steps_join_the_development_rows_with_their_provenance():
    """The GPU kit's H200 times of this project's step: one develop row per measured point,
    seconds as measured, the project's own framework, documented as trained on."""
    with open(data_path(fleet.H200_STEP_CSV), newline="") as f:
        measured = {(r["model"], r["precision"]): float(r["seconds"]) for r in csv.DictReader(f)
                    if r["status"] == "ok"}  # fmt: skip
    rows = [r for r in fleet.load_fleet("develop") if r.source == fleet.H200_STEP_CSV]
    assert {(r.model, r.precision): r.seconds for r in rows} == measured
    assert {(r.device, r.gpus, r.options.framework) for r in rows} == {("h200", 1, "pytorch")}
    readme = data_path("README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(f"| `{fleet.H200_STEP_CSV}`"))
    assert "train" in line and "gpu/h200-2026-12-04-rerun/" in line
    # a run measured at many precisions pairs its bf16 row with its fp8 rows only
    pairs = fleet.precision_pairs(rows)
    assert pairs and {b.precision for _, b in pairs} == {"fp8", "fp8-current"}
