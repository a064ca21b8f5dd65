"""One Precision table owns dtype behaviour: a toy entry flows through every reader, and the
fp8 entries are priced as Transformer Engine runs them."""

import pytest
import torch

from predictors.devices import UnsupportedPrecisionError, get_device
from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec
from predictors.spec.precision import (
    Fp8Recipe,
    Precision,
    UnknownPrecisionError,
    get_precision,
    megatron_precisions,
    register_precision,
    unregister_precision,
)
from predictors.time.features import features, precision_feature_names, step_work
from predictors.time.predictor import predict, predict_iteration_time

SMALL = TransformerSpec("gpt", 4, 256, 4, 128, 1024)
S = ParallelStrategy(2, 2, 1, 2, 8)


@pytest.fixture
def toy():
    """A half-precision autocast with fp32 masters and no loss scaling: one entry, nothing else."""
    p = register_precision(Precision("toy-fp16-masters", torch.float32, torch.float16, True, True,
                                     False, extra_features={"toy_bit": 1.0}))  # fmt: skip
    yield p
    unregister_precision(p.name)


def test_toy_precision_flows_through_without_other_edits(toy):
    from predictors.step import trace_training_step
    from predictors.time.collect import default_grid
    from predictors.time.trace import OpTracer

    # time predictor (trace -> analytical -> features -> learned correction)
    t = predict_iteration_time(SMALL, S, "toy-fp16-masters", "a100-80gb")
    assert t > 0 and t != predict_iteration_time(SMALL, S, "fp32", "a100-80gb")
    row = features(SMALL, S, "toy-fp16-masters", get_device("a100-80gb"))
    assert row["toy_bit"] == 1.0 and row["compute_bits"] == 16 and row["master_fp32"] == 1.0
    assert "toy_bit" in precision_feature_names()  # dropped for single-precision training data
    # matmuls ran in fp16 under the emulated CUDA autocast; masters exist
    tracer = OpTracer()
    step = trace_training_step(lambda: torch.nn.Linear(16, 16), _batch, "toy-fp16-masters",
                               modes=[tracer], on_phase=tracer.on_phase)  # fmt: skip
    assert {r.dtype for r in tracer.trace.records if r.op_class == "matmul"} == {"float16"}
    assert step.masters and step.scaler is None
    # collect's grid offers it on a CPU
    assert any(p.precision == "toy-fp16-masters" for p in default_grid(models=["gpt-xs"]))


def _batch():
    from predictors.step import Batch

    return Batch([torch.randn(4, 16)], torch.randn(4, 16))


def test_bad_entries_and_names_are_named():
    with pytest.raises(UnknownPrecisionError, match="precision='fp4'"):
        get_precision("fp4")
    with pytest.raises(ValueError, match="emulation='bogus'"):
        Precision("x", torch.float32, torch.float32, False, False, False, emulation="bogus")
    with pytest.raises(ValueError, match="requires_rate='fp6'"):
        Precision("x", torch.float32, torch.float32, False, False, False, requires_rate="fp6")
    with pytest.raises(ValueError, match="already registered"):
        register_precision(get_precision("fp32"))
    with pytest.raises(UnknownPrecisionError, match="recipe.fallback='nope'"):
        register_precision(Precision("y", torch.bfloat16, torch.bfloat16, False, True, False,
                                     emulation="te_fp8", recipe=Fp8Recipe("delayed", fallback="nope")))  # fmt: skip
    # mxfp8 needs the device's mxfp8 column (Blackwell), which no Hopper has
    with pytest.raises(UnsupportedPrecisionError, match="'mxfp8' rate"):
        predict_iteration_time(SMALL, S, "mxfp8", "h100-80gb")
    assert predict_iteration_time(SMALL, S, "mxfp8", "b200") > 0
    assert megatron_precisions() == ("fp32", "bf16-mixed", "fp16-mixed")


def _work(precision: str, strategy=S):
    return step_work(SMALL, strategy, get_precision(precision), get_device("h100-80gb"))


def test_fp8_covers_the_layers_linears_only():
    work = _work("fp8")
    fp8 = [r for r in work.fwd_bwd.records if r.dtype_class == "fp8"]
    # 4 linears per layer (qkv, proj, fc1, fc2) x 3 GEMMs (fwd, dgrad, wgrad) x 4 layers
    assert len(fp8) == 4 * 3 * 4 and {r.name for r in fp8} == {"_scaled_mm"}
    # attention BMMs and the LM head stay bf16
    assert all(r.dtype == "bfloat16" for r in work.fwd_bwd.records if r.op_class == "attention")
    head = [r for r in work.fwd_bwd.records if r.op_class == "matmul" and r.dtype_class != "fp8"]
    assert head and {r.dtype for r in head} == {"bfloat16"}
    assert work.fp8_tensors == len(fp8)


def test_recipes_cost_what_they_run():
    dev = get_device("h100-80gb")
    delayed, current = _work("fp8"), _work("fp8-current")
    norms = [r for r in current.fwd_bwd.records if r.name == "linalg_vector_norm"]
    assert len(norms) == 4 * 3 * 4  # one amax pass per quantised tensor
    assert not [r for r in delayed.fwd_bwd.records if r.name == "linalg_vector_norm"]
    b_delayed = predict(SMALL, S, "fp8", dev).breakdown
    b_current = predict(SMALL, S, "fp8-current", dev).breakdown
    assert b_delayed.fp8_recipe_s > 0  # amax all-reduce over DP + history/scale update
    assert b_current.fp8_recipe_s > 0  # per-tensor amax all-reduce over TP
    assert predict(SMALL, S, "bf16-mixed", dev).breakdown.fp8_recipe_s == 0


def test_activation_checkpointing_and_fsdp():
    dev = get_device("h100-80gb")
    s = ParallelStrategy(8, 1, 1, 1, 8)
    plain = predict(SMALL, s, "bf16-mixed", dev).breakdown
    ckpt = predict(SMALL, s, "bf16-mixed", dev,
                   options=TrainingOptions(recompute="full")).breakdown  # fmt: skip
    assert ckpt.recompute_mb > 0
    assert ckpt.compute_mb == pytest.approx(plain.compute_mb + ckpt.recompute_mb)
    fsdp = predict(SMALL, s, "bf16-mixed", dev, options=TrainingOptions(fsdp=True)).breakdown
    assert fsdp.dp_comm == 0 and fsdp.dp_comm_raw == 0  # no separate gradient all-reduce
    assert fsdp.optimizer == pytest.approx(plain.optimizer / 8)  # sharded optimizer step
    # 3 half-all-reduces of the parameters per micro-batch cross the NVLink
    assert fsdp.intra_bytes > 1.4 * plain.intra_bytes
