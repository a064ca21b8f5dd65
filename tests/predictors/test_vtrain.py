"""vTrain ground truth: shipped with its licence, loaded faithfully, predicted held out by size."""

import pytest

from predictors.datasets import data_path
from predictors.datasets.vtrain import VTRAIN_CSV, VTRAIN_LICENSE, load_vtrain
from predictors.time.evaluate import evaluate_vtrain


def test_shipped_with_licence():
    assert data_path(VTRAIN_CSV).exists()
    assert "Permission is hereby granted" in data_path(VTRAIN_LICENSE).read_text()


def test_loader():
    rows = load_vtrain()
    assert len(rows) == 1440
    assert {r.spec.hidden_size for r in rows} == {1024, 2048}
    assert {r.spec.num_layers for r in rows} == {12, 16, 20, 24}
    assert all(r.strategy.world_size in (2, 4, 8) for r in rows)
    assert all(0.01 < r.seconds < 100 for r in rows)
    assert len({r.size for r in rows}) == 8


@pytest.mark.slow
def test_heldout_splits_fit_constants_inside_each_fold():
    """Both directions of the unseen-hidden split and every depth group held out, each with
    constants of its own fold. Their accuracy (U, D, and the roofline alone beside them) is
    timing-derived, so it is benchmarks/bench_time_predictor.py's figure (issue 44: no accuracy
    threshold in a unit test)."""
    res = evaluate_vtrain()
    by_depth, unseen = res["by_depth"], res["unseen_hidden"]
    assert set(unseen.per_group) == {"h1024", "h2048"} == set(unseen.constants)
    assert len(unseen.measured) == 1440 and len(by_depth.per_group) == 8
    assert set(by_depth.per_group) == set(by_depth.constants) == {r.size for r in load_vtrain()}
    for split in (unseen, by_depth):
        assert len(split.predicted) == 1440 and (split.predicted > 0).all()


def test_vtrain_rows_run_megatrons_unfused_attention():
    """vTrain's layers are Megatron-DeepSpeed's classic core attention (its own model of them,
    VIA-Research/vTrain src/model/gpt_modeling.py): a [b*heads, s, s] scores GEMM, softmax and
    dropout over it, a second batched GEMM; no fused attention kernel. The traced layer carries
    that s^2 traffic, and its batch extrapolation (traces at 2 and 3) matches a direct trace."""
    from dataclasses import replace

    from predictors.spec import TransformerSpec
    from predictors.time.features import _at_batch, _canonical, _part_trace

    spec = load_vtrain()[0].spec
    assert {r.spec.attention for r in load_vtrain()} == {"unfused"}
    small = _canonical(replace(spec, hidden_size=128, num_attention_heads=4, seq_length=256))
    b, n, s = 3, 4, 256
    fwd = [r for r in _part_trace("layer", small, 1, b, "fp16-mixed", "cuda")[0].records
           if r.phase == "forward"]  # fmt: skip
    names = [r.name for r in fwd]
    assert "baddbmm" in names and not any("attention" in x for x in names)
    scores = next(r for r in fwd if r.name == "baddbmm")
    assert scores.out_shapes[0] == (b * n, s, s) and not scores.causal
    softmax = next(r for r in fwd if r.op_class == "softmax")
    assert softmax.bytes >= 2 * b * n * s * s * 2  # fp16 in and out
    direct = _part_trace("layer", small, 1, 5, "fp16-mixed", "cuda")[0]
    est = _at_batch("layer", small, 1, 5, "fp16-mixed", "cuda")[0]
    assert est.total("flops") == pytest.approx(direct.total("flops"))
    assert est.total("bytes") == pytest.approx(direct.total("bytes"))
    with pytest.raises(ValueError, match="attention='bogus'"):
        TransformerSpec("gpt", 2, 64, 4, 32, 512, attention="bogus")
