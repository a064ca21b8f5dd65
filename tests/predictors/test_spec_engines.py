"""Round trips between the one spec (:mod:`predictors.spec`) and every engine's configuration:
Hugging Face configs, vLLM's ModelConfig, Megatron-Core's TransformerConfig and Megatron-LM's
flags (parsed by CONA's Megatron-LM-compatible parser); and the predictors taking the one spec
where they took a translation before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from predictors.memory.presets import PRESETS
from predictors.spec import (
    ModelSpec,
    ModelSpecError,
    ParallelStrategy,
    TrainingOptions,
    TransformerSpec,
    UnknownModelError,
)
from predictors.spec.engines import (
    from_megatron_args,
    hf_text_config,
    hf_vision_config,
    megatron_args,
    megatron_transformer_config,
    text_spec_from_hf,
    text_spec_from_megatron,
    text_spec_from_vllm,
    vision_spec_from_hf,
)

TEXT = sorted({m.text for m in PRESETS.values() if m.text is not None}, key=repr)
VISION = sorted({m.vision for m in PRESETS.values() if m.vision is not None}, key=repr)
GQA = TransformerSpec("llama", 8, 512, 8, 1024, 32000, ffn_hidden_size=1376, num_query_groups=2,
                      swiglu=True, tied_embeddings=False)


@pytest.mark.parametrize("t", TEXT, ids=lambda t: f"{t.family}-h{t.hidden_size}")
def test_text_tower_round_trips_through_its_hf_config(t):
    cfg = hf_text_config(t)
    assert cfg.model_type == t.family and cfg.num_key_value_heads == t.kv_heads
    assert text_spec_from_hf(cfg) == t
    # and the other way: an HF config survives spec and back
    assert hf_text_config(text_spec_from_hf(cfg)).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("v", VISION, ids=lambda v: f"{v.family}-{v.image_size}")
def test_vision_tower_round_trips_through_its_hf_config(v):
    assert vision_spec_from_hf(hf_vision_config(v)) == v


def test_a_family_without_an_hf_config_is_named():
    with pytest.raises(UnknownModelError, match="family='gpt'"):
        hf_text_config(TransformerSpec("gpt", 2, 64, 4, 128, 1000))


def test_text_tower_round_trips_through_megatron_core_transformer_config():
    strategy = ParallelStrategy(2, 2, 2, 1, None, 2)
    cfg = megatron_transformer_config(GQA, strategy)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
            cfg.context_parallel_size) == (2, 2, 2)  # fmt: skip
    assert cfg.gated_linear_unit and cfg.num_query_groups == 2 and cfg.bf16 and not cfg.fp16
    assert text_spec_from_megatron(cfg, "llama", GQA.seq_length, GQA.vocab_size,
                                   tied_embeddings=False) == GQA  # fmt: skip


def test_megatron_flags_round_trip_through_conas_megatron_parser():
    from megatron_cona.pretrain_gpt import model_spec, parse_args

    strategy = ParallelStrategy(2, 2, 2, micro_batch=2, global_batch=16)
    options = TrainingOptions(distributed_optimizer=True)
    argv = megatron_args(GQA, strategy, options) + ["--train-iters", "10", "--lr", "1e-4"]
    args = parse_args(argv, ignore_unknown_args=True)
    spec, got_strategy, got_options = from_megatron_args(args, world_size=8, family="llama",
                                                         vocab_size=GQA.vocab_size)
    assert (spec, got_strategy, got_options) == (GQA, strategy, options)
    # CONA's own reading of the same flags names the same tower (its fixed vocabulary aside)
    cona = model_spec(args)
    assert replace(cona, family="llama", vocab_size=GQA.vocab_size) == GQA


def test_megatron_flags_carry_the_schedule_options():
    """Flags CONA's parser does not define, read back by a parser that does (Megatron-LM's
    names and defaults for them)."""
    import argparse

    p = argparse.ArgumentParser()
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--ffn-hidden-size", "--micro-batch-size",
                 "--global-batch-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--num-query-groups",
                 "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                 "--recompute-num-layers"):  # fmt: skip
        p.add_argument(flag, type=int)
    for flag in ("--recompute-granularity", "--recompute-method"):
        p.add_argument(flag)
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
                 "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--tp-comm-overlap", "--sequence-parallel",
                 "--use-flash-attn"):  # fmt: skip
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm")  # fmt: skip
    strategy = ParallelStrategy(1, 2, 2, 1, 8, cp=2)
    options = TrainingOptions(overlap_grad_reduce=True, tp_comm_overlap=True, virtual_pipeline=2,
                              distributed_optimizer=True, overlap_param_gather=True,
                              sequence_parallel=True, overlap_p2p_comm=False,
                              recompute="full")  # fmt: skip
    unfused = replace(GQA, attention="unfused")
    args = p.parse_args(megatron_args(unfused, strategy, options))
    assert from_megatron_args(args, 8, "llama", GQA.vocab_size) == (unfused, strategy, options)


@pytest.mark.slow  # vLLM's import and config resolution: ~15 s on 2 busy cores
def test_text_tower_round_trips_through_vllm_model_config(tmp_path):
    from vllm.config import ModelConfig

    hf_text_config(GQA).save_pretrained(tmp_path)
    mc = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=GQA.seq_length)
    assert text_spec_from_vllm(mc) == GQA


def test_time_predictor_takes_the_one_model_spec():
    from predictors.time.predictor import predict_iteration_time

    t = TransformerSpec("gpt", 2, 256, 4, 256, 1000)
    s = ParallelStrategy(1, 1, 1)
    assert predict_iteration_time(ModelSpec.language_model(t), s, "bf16", "a100-80gb") == \
        predict_iteration_time(t, s, "bf16", "a100-80gb")
    with pytest.raises(ModelSpecError, match="vision tower"):
        predict_iteration_time(PRESETS["llava-1.5-7b-like"], s, "bf16", "a100-80gb")


def test_memory_predictor_takes_the_text_tower_and_strategy_cona_ranks():
    """A GELU text tower goes to the memory walk as the SwiGLU layer with its MLP's parameter
    count: the same prediction as that Llama tower written out by hand."""
    from predictors.memory.api import predict_peak_memory

    gpt = TransformerSpec("gpt", 24, 2048, 16, 2048, 50304)
    strategy = ParallelStrategy(2, 2, 2, micro_batch=2, global_batch=16)
    got = predict_peak_memory(gpt, strategy, precision="bf16")
    llama = replace(gpt, family="llama", swiglu=True, ffn_hidden_size=2 * 4 * 2048 // 3)
    by_hand = predict_peak_memory(ModelSpec("by-hand", "llm", text=llama),
                                  ParallelStrategy(2, 2, 2, micro_batch=2, global_batch=16),
                                  precision="bf16")
    assert got.device_total == by_hand.device_total and got.components == by_hand.components


def test_memory_cli_takes_the_strategy_the_time_cli_takes(capsys):
    from predictors.cli import main

    code = main(["memory", "--model", "llama-7b-like", "--strategy", "dp2tp2pp2mb1gb8",
                 "--capacity-gib", "80"])
    out = capsys.readouterr().out
    assert code in (0, 2) and "tp 2 pp 2" in out and "batch 1" in out
    assert main(["memory", "--model", "llama-7b-like", "--strategy", "dp2tp2"]) == 1
    assert "StrategyError" in capsys.readouterr().err


def test_memory_predictor_takes_the_one_training_options():
    from predictors.memory.api import predict_peak_memory

    strategy = ParallelStrategy(4, 2, 1, micro_batch=2, global_batch=16)
    for options, zero, ckpt in ((TrainingOptions(distributed_optimizer=True, recompute="full"),
                                 1, "full"),
                                (TrainingOptions(fsdp=True, framework="deepspeed"), 3, "none")):
        # DeepSpeed keeps fp32 masters: its step is read at a *-mixed precision
        got = predict_peak_memory("llama-7b-like", strategy, options, "bf16-mixed")
        assert (got.step.zero, got.step.checkpointing) == (zero, ckpt)
        stage = TrainingOptions.for_zero_stage(zero, recompute=ckpt, framework=options.framework)
        assert stage.zero_stage == zero
        assert got.device_total == predict_peak_memory("llama-7b-like", strategy, stage,
                                                       "bf16-mixed").device_total
    with pytest.raises(ModelSpecError, match="recompute='selective'"):
        predict_peak_memory("llama-7b-like", options=TrainingOptions(recompute="selective"))


@pytest.mark.parametrize("options", [TrainingOptions.for_zero_stage(2),
                                     TrainingOptions(fsdp=True)])
def test_memory_api_refuses_megatron_beyond_zero_1_as_the_cli_does(options, capsys):
    """predict_peak_memory priced Megatron (the options' default framework) at ZeRO 2/3 as the
    generic sharded step without its gradient buffer, which the CLI refused: 27.9 GiB below
    ZeRO 1's price for LLaVA-1.5-7B at dp 1, where there is nothing to shard. Both refuse it
    with one message (device.unmodelled_zero)."""
    from predictors.cli import main
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import ShardingError

    zero = options.zero_stage
    message = (f"zero={zero} with framework='megatron' (--zero {zero} --framework megatron): "
               "Megatron shards optimizer states only (zero 1, its distributed optimizer) and "
               "its gradient buffer is priced at zero 0 or 1; choose one of them")
    with pytest.raises(ShardingError) as refused:
        predict_peak_memory("llava-1.5-7b-like", options=options)
    assert str(refused.value) == message
    assert main(["memory", "--model", "llava-1.5-7b-like", "--framework", "megatron",
                 "--zero", str(zero)]) == 1
    assert capsys.readouterr().err == f"error: ModelSpecError: {message}\n"


@pytest.mark.parametrize("precision, zero", [("bf16-pure", 1), ("fp16-pure", 2),
                                             ("bf16-pure", 3)])
def test_deepspeed_zero_with_a_pure_precision_is_refused_on_every_path(precision, zero, capsys):
    """DeepSpeed's ZeRO optimizer copies bf16/fp16 weights to fp32 masters whatever its config
    (stage_1_and_2.py single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat;
    fp16 masters only with ZeRO-Offload): a *-pure precision at ZeRO 1-3 was priced as a step
    DeepSpeed never runs, without the masters (at dp 1 the analytical path priced it; the
    traced path did everywhere). The API, the traced path and the CLI refuse it with one
    message (device.unrun_precision)."""
    from predictors.cli import main
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import ShardingError
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    weights = precision.split("-")[0]
    mixed = f"{weights}-mixed"
    message = (f"precision={precision!r} with framework='deepspeed' at zero={zero} (--precision "
               f"{precision} --framework deepspeed --zero {zero}): DeepSpeed's ZeRO optimizer "
               f"keeps fp32 masters of {weights} weights whatever its config (fp16 masters only "
               "with ZeRO-Offload, not modelled), so no DeepSpeed job steps without them; "
               f"choose {mixed}, or zero 0 (a model cast to {weights} without a \"bf16\"/"
               "\"fp16\" config section, stepped as it is)")
    options = TrainingOptions.for_zero_stage(zero, framework="deepspeed")
    with pytest.raises(ShardingError) as refused:
        predict_peak_memory("qwen2-1.5b-like", options=options, precision=precision)
    assert str(refused.value) == message
    mlp = MlpSpec(64, (64,), 10)
    with pytest.raises(ShardingError) as refused:
        predict_module_memory(mlp.build(), *mlp.example(4), options=options, precision=precision)
    assert str(refused.value) == message
    for model in ("qwen2-1.5b-like", "mlp"):
        assert main(["memory", "--model", model, "--framework", "deepspeed", "--zero",
                     str(zero), "--precision", precision]) == 1
        assert capsys.readouterr().err == f"error: ModelSpecError: {message}\n"
    # the mixed precision is DeepSpeed's config of those weights, and is priced
    assert predict_peak_memory("qwen2-1.5b-like", options=options, precision=mixed).fits


def test_deepspeed_zero_0_with_a_pure_precision_reduces_an_fp32_cast_of_its_bucket():
    """A *-pure precision is a real DeepSpeed job at ZeRO 0: a model cast to bf16/fp16 with no
    "bf16"/"fp16" config section, which the engine steps as it is (engine.py: __check_params
    returns at once, get_data_types -> fp32, no optimizer wrapper). Its
    communication_data_type is then fp32, so allreduce_bucket casts each flat bucket to an
    fp32 copy (tensor.to(...)) beside it, which was not priced (v0.9.5, v0.12.6)."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    ds0 = TrainingOptions(framework="deepspeed")
    for precision in ("bf16-pure", "fp16-pure"):
        pure = predict_peak_memory("qwen2-1.5b-like", options=ds0, precision=precision)
        assert pure.components["ds_allreduce_cast"] == 2 * pure.components["ds_allreduce_bucket"]
    mixed = predict_peak_memory("qwen2-1.5b-like", options=ds0, precision="bf16-mixed")
    assert "ds_allreduce_cast" not in mixed.components  # reduced in bf16, its config's dtype
    mlp = MlpSpec(64, (64,), 10)
    n = sum(q.numel() for q in mlp.build().parameters())
    traced = predict_module_memory(mlp.build(), *mlp.example(4), options=ds0,
                                   precision="bf16-pure").inside_allocator
    assert (traced["ds_allreduce_bucket"], traced["ds_allreduce_cast"]) == (2 * n, 4 * n)


def test_megatron_uneven_pipeline_flags_round_trip():
    """Megatron's uneven split (--decoder-first/last-pipeline-num-layers) survives flags and
    back, and the split is the one Megatron builds: the stages between share the rest."""
    import argparse

    p = argparse.ArgumentParser()
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--ffn-hidden-size", "--micro-batch-size",
                 "--global-batch-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--num-query-groups",
                 "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers"):  # fmt: skip
        p.add_argument(flag, type=int)
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
                 "--use-flash-attn"):
        p.add_argument(flag, action="store_true")
    deep = replace(GQA, num_layers=126)
    for first, last in ((15, 15), (14, None), (None, 7)):
        strategy = ParallelStrategy(1, 1, 8, 1, 8, first_stage_layers=first,
                                    last_stage_layers=last)  # fmt: skip
        argv = megatron_args(deep, strategy)
        assert ("--decoder-first-pipeline-num-layers" in argv) == (first is not None)
        assert ("--decoder-last-pipeline-num-layers" in argv) == (last is not None)
        spec, got, _ = from_megatron_args(p.parse_args(argv), 8, "llama", GQA.vocab_size)
        assert (spec, got) == (deep, strategy)
        assert ParallelStrategy.parse(strategy.name) == strategy
        stages = got.stage_layers(deep.num_layers)
        assert len(stages) == 8 and sum(stages) == 126 and len(set(stages[1:-1])) == 1
    assert ParallelStrategy(1, 1, 8, first_stage_layers=15, last_stage_layers=15).stage_layers(
        126) == (15, 16, 16, 16, 16, 16, 16, 15)


def test_uneven_pipeline_split_errors_name_the_field():
    from predictors.spec import StrategyError

    with pytest.raises(StrategyError, match="pp=8 does not divide num_layers=126"):
        ParallelStrategy(1, 1, 8).check(8, replace(GQA, num_layers=126))
    with pytest.raises(StrategyError, match="first_stage_layers=13 and last_stage_layers=14 "
                                            "leave 99"):
        ParallelStrategy(1, 1, 8, first_stage_layers=13, last_stage_layers=14).check(
            8, replace(GQA, num_layers=126))
    with pytest.raises(StrategyError, match="first_stage_layers=4 needs pp > 1"):
        ParallelStrategy(1, 1, 1, first_stage_layers=4)
    with pytest.raises(StrategyError, match="last_stage_layers=0"):
        ParallelStrategy(1, 1, 4, last_stage_layers=0)


@pytest.mark.parametrize("argv, field", [
    (["--model", "foo"], "--model 'foo' is unknown"),
    (["--layers", "0"], "num_layers=0 must be a positive integer"),
    (["--hidden", "-64", "--heads", "1"], "hidden_size=-64"),
    (["--vocab", "0"], "vocab_size=0"),
    (["--kv-heads", "0"], "num_query_groups=0"),
    (["--ffn", "-5"], "ffn_hidden_size=-5"),
    (["--heads", "15"], "num_attention_heads=15"),
    (["--model", "gpt-s", "--layers", "48", "--ffn", "8192"],
     "--layers, --ffn: the zoo model 'gpt-s' fixes its own size"),
])
def test_time_cli_names_the_bad_field_instead_of_a_traceback_or_a_guess(capsys, argv, field):
    """An unknown --model used to be priced as a GPT of that name, a zero size as a model of
    nothing, a negative one reached torch as a traceback, and a size given with a zoo model
    was ignored without a word."""
    from predictors.cli import main

    assert main(["time", *argv]) == 1  # 2 is predict memory's oom
    err = capsys.readouterr().err
    assert err.startswith("predict time: error:") and field in err


def test_a_text_tower_of_no_size_is_refused_naming_the_field():
    from predictors.spec import ModelSpecError

    with pytest.raises(ModelSpecError, match="seq_length=nan"):
        TransformerSpec("gpt", 2, 64, 4, float("nan"), 100)
    assert TransformerSpec("gpt", 2, 64, 4, 16, 100, num_query_groups=None).kv_heads == 4


@pytest.mark.parametrize("argv, message", [
    (["--capacity-gib", "-1"], "capacity_gib='-1' must be a positive number of GiB"),
    (["--capacity-gib", "nan"], "capacity_gib='nan' must be a positive number of GiB"),
    (["--optimizer", "sgd"], "add --trace"),
    (["--device", "tpu"], "device='tpu' is unknown"),
])
def test_memory_cli_refuses_what_a_preset_used_to_misread_or_drop(capsys, argv, message):
    """A negative capacity was judged as such, NaN raised a message naming no field, and
    --device / --optimizer were dropped without a word on the preset path."""
    from predictors.cli import main

    assert main(["memory", "--model", "llama-7b-like", *argv]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model, argv", [
    *[(model, ["--seq", "4096"]) for model in ("mlp", "cnn", "module", "vit-l-like")],
    *[(model, ["--image-res", "64"]) for model in ("mlp", "module", "llama-7b-like")],
    *[(model, ["--images-per-sample", "2"])
      for model in ("mlp", "cnn", "module", "llama-7b-like", "vit-l-like")],
    ("llava-1.5-7b-like", ["--input", "784", "--hidden", "8", "--channels", "8", "--kernel",
                           "3", "--classes", "10", "--activation", "relu", "--batchnorm",
                           "--dropout", "0.1", "--last-batch", "1"]),
    ("llama-7b-like", ["--module", "memory_factory:make", "--input-shape", "3x16x16"]),
    ("mlp", ["--channels", "8", "--kernel", "3"]),
    ("cnn", ["--input", "8", "--hidden", "8", "--dropout", "0.1"]),
    ("cnn", ["--module", "memory_factory:make", "--input-shape", "3x16x16"]),
    ("module", ["--classes", "10", "--activation", "gelu"]),
    # a preset's flags, given their own defaults: "given" is not "differs from the default"
    ("mlp", ["--trace", "--strategy", "dp1tp1pp1", "--checkpointing", "none", "--attention",
             "flash", "--freeze", "vision", "--lora-rank", "8", "--lora-bits", "16"]),
    ("vit-l-like", ["--lora-rank", "8"]),
])
def test_memory_cli_refuses_a_flag_the_model_does_not_read(capsys, model, argv):
    """A flag only other kinds of model read (--seq without a text part, --image-res without
    an image, --images-per-sample without both a vision and a text part, an mlp's sizes on a
    cnn or a preset, a preset's options on mlp/cnn/module) was ignored without a word, and the
    user believed it priced: refused naming each, with exit status 1 (2 is "oom")."""
    from predictors.cli import main

    flags = [a for a in argv if a.startswith("--")]
    assert main(["memory", "--model", model, *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: ModelSpecError: {flags[0]}: the model {model!r} has no ")
    assert [f for f in flags if f"{f}: the model {model!r} has no " not in err] == []
    assert err.rstrip().endswith(f"reads it); drop {', '.join(flags)}")


def test_memory_cli_says_what_a_model_lacks_and_which_models_read_the_flag(capsys):
    from predictors.cli import main

    assert main(["memory", "--model", "llama-7b-like", "--image-res", "336", "--seq", "512",
                 "--images-per-sample", "2"]) == 1
    assert capsys.readouterr().err == (
        "error: ModelSpecError: --image-res: the model 'llama-7b-like' has no image resolution "
        "(only cnn or a preset with a vision part reads it); --images-per-sample: the model "
        "'llama-7b-like' has no text to interleave images with (only a preset with a vision "
        "and a text part reads it); drop --image-res, --images-per-sample\n")


# the one framework a preset's analytical model reads: DeepSpeed's ZeRO 2/3 step (fp32 masters)
DEEPSPEED_STEP = ["--zero", "2", "--dp", "8", "--framework", "deepspeed", "--precision",
                  "bf16-mixed"]


@pytest.mark.parametrize("model, argv, message", [
    ("llama-7b-like", ["--lora-bits", "4"],
     "--lora-bits: without --lora-rank there are no LoRA adapters"),
    ("llama-7b-like", ["--lora-bits", "16"],  # given, not "differs from the default"
     "--lora-bits: without --lora-rank there are no LoRA adapters"),
    ("llama-7b-like", ["--freeze", "vision"],
     "--freeze: the model 'llama-7b-like' has no tower 'vision' (its towers: llm)"),
    ("llama-7b-like", ["--freeze", "llm,bogus"],
     "--freeze: the model 'llama-7b-like' has no tower 'bogus' (its towers: llm)"),
    ("vit-l-like", ["--freeze", "llm,projector"], "--freeze: the model 'vit-l-like' has no "
     "tower 'llm', 'projector' (its towers: vision, head)"),
    ("llava-1.5-7b-like", ["--freeze", "head"], "--freeze: the model 'llava-1.5-7b-like' has "
     "no tower 'head' (its towers: vision, projector, llm)"),
    ("llama-7b-like", ["--context-mib", "600"],
     "--context-mib: the analytical model of 'llama-7b-like' prices the device's own CUDA "
     "context (only mlp, cnn, module or a preset with --trace reads it); add --trace"),
    ("llama-7b-like", ["--strategy", "dp2tp1pp1", "--batch", "4"],
     "--batch with --strategy: its mb<M> is the batch"),
    ("llama-7b-like", ["--strategy", "dp2tp1pp1", "--dp", "2"],
     "--dp with --strategy: its mb<M> is the batch and dp<D> the data-parallel degree; drop "
     "--dp or --strategy"),
    ("llama-7b-like", ["--strategy", "dp2tp1pp1", "--trace", "--batch", "1", "--dp", "1"],
     "--batch, --dp with --strategy:"),
    ("mlp", ["--batchnorm"], "--batch 1 with --batchnorm: an mlp's BatchNorm1d needs 2 or more "
     "samples to train (torch refuses 1); give --batch 2 or more or drop --batchnorm"),
    ("mlp", ["--batchnorm", "--batch", "8", "--last-batch", "1"],
     "--last-batch 1 with --batchnorm: an mlp's BatchNorm1d needs 2 or more samples"),
    *[("llava-1.5-7b-like", ["--zero", "1", "--dp", "8", "--optimizer", f"adam:{impl}"],
       f"--optimizer 'adam:{impl}': the analytical model of 'llava-1.5-7b-like' prices fused "
       f"Adam(W), not {impl}; add --trace to price {impl} or drop ':{impl}'")
      for impl in ("foreach", "for-loop")],
    ("llama-7b-like", [*DEEPSPEED_STEP, "--optimizer", "adamw:fused"],
     "--optimizer 'adamw:fused': the analytical model of 'llama-7b-like' prices torch's "
     "foreach Adam(W) on DeepSpeed's ZeRO 2/3 sub-groups, not fused; add --trace"),
    # one rule with the API's refusal (device.unpriced_framework): --trace prices DeepSpeed at
    # ZeRO 0/1, neither path torchtitan's or LLM Foundry's sharding (it said "add --trace")
    *[("llava-1.5-7b-like", ["--zero", "1", "--dp", "8", "--framework", framework],
       f"framework='{framework}' at dp=8 (--framework {framework} --dp 8): beyond one rank the "
       "analytical model prices the data-parallel buffers of pytorch and megatron (torch DDP's "
       "gradient buckets, Megatron's gradient buffer) and of deepspeed at its ZeRO 2/3 step "
       "with fp32 masters (a *-mixed or fp8 precision; its buckets), and NCCL's buffers of "
       f"every framework; {remedy}\n")
      for framework, remedy in (
          ("deepspeed", "the traced path (--trace, predict_spec_memory) prices this one"),
          ("torchtitan", "torchtitan's FSDP2 (fully_shard: its all-gather and reduce-scatter "
           "buffers) is not modelled on either path (the traced path runs pytorch, deepspeed "
           "and megatron)"),
          ("llm-foundry", "LLM Foundry's FSDP1 through Composer (its flat parameters' "
           "all-gather and reduce-scatter buffers) is not modelled on either path (the "
           "traced path runs pytorch, deepspeed and megatron)"))],
    # dp<D> of --strategy counts as --dp does
    ("llama-7b-like", ["--strategy", "dp8tp1pp1", "--framework", "torchtitan"],
     "framework='torchtitan' at dp=8 (--framework torchtitan --dp 8): beyond one rank"),
    # DeepSpeed's step needs fp32 masters: at bf16 (fp32 weights under autocast) it is not read
    ("llama-7b-like", [*DEEPSPEED_STEP[:-2], "--precision", "bf16"],
     "framework='deepspeed' at dp=8 (--framework deepspeed --dp 8): beyond one rank"),
    # the traced paths price the framework's own fused kernel: another implementation given
    # explicitly was priced as fused without a word
    ("mlp", ["--optimizer", "adam:foreach", "--framework", "deepspeed"],
     "--optimizer 'adam:foreach' with --framework deepspeed: DeepSpeed steps Adam with its own "
     "fused kernel (the FusedAdam of an \"optimizer\" config section, the DeepSpeed the traced "
     "path models), which the traced path prices; drop ':foreach'\n"),
    ("cnn", ["--optimizer", "sgd:for-loop", "--framework", "megatron"],
     "--optimizer 'sgd:for-loop' with --framework megatron: Megatron steps SGD with its own "
     "fused kernel (Transformer Engine's or Apex's) whatever the script asks, which the traced "
     "path prices; drop ':for-loop'\n"),
    ("vit-b-like", ["--trace", "--optimizer", "adamw:for-loop", "--framework", "megatron"],
     "--optimizer 'adamw:for-loop' with --framework megatron: Megatron steps AdamW"),
    # ... and named with the path that prices it: the analytical model prices DeepSpeed's ZeRO
    # 2/3 step with the script's foreach AdamW, the traced path Megatron's fused Adam
    ("vit-b-like", ["--trace", *DEEPSPEED_STEP, "--optimizer", "adamw:foreach"],
     "DeepSpeed steps AdamW with its own fused kernel (the FusedAdam of an \"optimizer\" "
     "config section, the DeepSpeed the traced path models), which the traced path prices; "
     "drop ':foreach' or drop --trace (the analytical model prices DeepSpeed stepping the "
     "script's torch foreach Adam(W), a config without an \"optimizer\" section)"),
    ("llava-1.5-7b-like", ["--framework", "megatron", "--optimizer", "adam:foreach"],
     "--optimizer 'adam:foreach': the analytical model of 'llava-1.5-7b-like' prices fused "
     "Adam(W), not foreach; drop ':foreach' (--framework megatron: Megatron steps Adam with its "
     "own fused kernel (Transformer Engine's or Apex's) whatever the script asks, which --trace "
     "prices)"),
    # Megatron's gradient buffer is priced at --zero 0/1: at 2/3 the walk priced the generic
    # sharded step without it, so at --dp 1 (nothing to shard) --zero 2 fit where --zero 1
    # was tight; the API and the traced path refuse it the same way (device.unmodelled_zero)
    *[(model, ["--framework", "megatron", "--zero", zero, *trace],
       f"zero={zero} with framework='megatron' (--zero {zero} --framework megatron): Megatron "
       "shards optimizer states only (zero 1, its distributed optimizer) and its gradient "
       "buffer is priced at zero 0 or 1; choose one of them\n")
      for zero in ("2", "3") for model, trace in (("llava-1.5-7b-like", []), ("mlp", []),
                                                 ("vit-b-like", ["--trace"]))],
])
def test_memory_cli_refuses_a_flag_another_flag_or_value_leaves_unread(capsys, model, argv,
                                                                         message):
    """A flag the model's kind reads but another flag or a value left unread was dropped
    without a word (--lora-bits without --lora-rank, --freeze of a tower the preset lacks,
    --context-mib on the analytical path, --batch/--dp beside --strategy; on the analytical
    path an --optimizer implementation other than the one it prices and a --framework beyond
    one rank other than DeepSpeed's ZeRO 2/3 step, both priced alike whatever was given), an
    unknown tower was refused naming neither --freeze nor the preset's towers, and an mlp
    with batchnorm at batch 1 failed in torch naming no flag: each refused naming the flags,
    exit 1."""
    from predictors.cli import main

    assert main(["memory", "--model", model, *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ModelSpecError: ") and message in err


def test_memory_cli_still_prices_the_flags_a_model_reads_and_their_defaults(capsys):
    """The flags now default to None (not given): not given, each still takes its documented
    default, and a flag the model reads still changes the price."""
    import json

    from predictors.cli import main

    def run(model, *argv):
        assert main(["memory", "--model", model, "--json", *argv]) in (0, 2, 3)
        return json.loads(capsys.readouterr().out)

    mlp = run("mlp", "--batch", "4")  # batchnorm needs more than one sample
    assert mlp == run("mlp", "--batch", "4", "--input", "784", "--hidden", "1024,1024",
                      "--classes", "10", "--activation", "relu", "--dropout", "0.0")
    assert mlp != run("mlp", "--batch", "4", "--dropout", "0.5", "--batchnorm")
    assert run("cnn", "--channels", "8", "--image-res", "32") == run(
        "cnn", "--channels", "8", "--image-res", "32", "--kernel", "3", "--classes", "10")
    llava = run("llava-1.5-7b-like")
    assert llava == run("llava-1.5-7b-like", "--images-per-sample", "1", "--checkpointing",
                        "none", "--attention", "flash")
    assert llava != run("llava-1.5-7b-like", "--images-per-sample", "2")
    assert llava != run("llava-1.5-7b-like", "--image-res", "224")
    # what _unread_with refuses still prices where the other flag or value is there
    assert llava == run("llava-1.5-7b-like", "--batch", "1", "--dp", "1")
    assert llava == run("llava-1.5-7b-like", "--strategy", "dp1tp1pp1mb1")
    assert llava != run("llava-1.5-7b-like", "--freeze", "vision,projector")
    assert run("blip2-3b-like") != run("blip2-3b-like", "--freeze", "")  # trains all towers
    assert run("vit-l-like") != run("vit-l-like", "--freeze", "head")
    lora = run("llama-7b-like", "--lora-rank", "8")
    assert lora == run("llama-7b-like", "--lora-rank", "8", "--lora-bits", "16")
    assert lora != run("llama-7b-like", "--lora-rank", "8", "--lora-bits", "4")
    assert run("cnn", "--channels", "8", "--image-res", "32", "--batchnorm") != run(
        "cnn", "--channels", "8", "--image-res", "32")  # BatchNorm2d trains at batch 1
    assert mlp != run("mlp", "--batch", "4", "--batchnorm", "--last-batch", "2")
    assert run("mlp", "--context-mib", "600") != run("mlp")


def test_memory_cli_prices_the_optimizer_and_framework_its_path_reads(capsys):
    """What the analytical path reads of --optimizer and --framework still prices there (a
    bare adam/adamw, the fused implementation it prices, DeepSpeed's ZeRO 2/3 step with
    torch's foreach AdamW, any framework on one rank, Megatron's gradient buffer there), not
    given they take their defaults, and the traced paths read both."""
    import json

    from predictors.cli import main

    def run(model, *argv):
        assert main(["memory", "--model", model, "--json", *argv]) in (0, 2, 3)
        return json.loads(capsys.readouterr().out)

    zero1 = ["--zero", "1", "--dp", "8"]
    llava = run("llava-1.5-7b-like", *zero1)
    assert llava == run("llava-1.5-7b-like", *zero1, "--optimizer", "adamw")
    assert llava == run("llava-1.5-7b-like", *zero1, "--optimizer", "adam:fused")
    assert llava == run("llava-1.5-7b-like", *zero1, "--framework", "pytorch")  # the default
    # one rank: torch DDP allocates nothing, Megatron still wraps the model in its DDP, whose
    # gradient buffer holds every gradient (fp32 at fp32 weights) in place of the walk's
    one, megatron = run("llava-1.5-7b-like"), run("llava-1.5-7b-like", "--framework", "megatron")
    assert "analytical.megatron_grad_buffer" not in one
    assert megatron["analytical.megatron_grad_buffer"] > one["analytical.gradients"] > 0
    assert megatron["analytical.gradients"] == 0
    assert megatron["max_memory_reserved"] > one["max_memory_reserved"]
    deepspeed = run("llama-7b-like", *DEEPSPEED_STEP)
    assert deepspeed == run("llama-7b-like", *DEEPSPEED_STEP, "--optimizer", "adamw:foreach")
    mlp = run("mlp", "--batch", "4", "--optimizer", "adam:for-loop")
    assert mlp != run("mlp", "--batch", "4", "--optimizer", "adam:fused")
    assert run("mlp", "--batch", "4", "--dp", "2") == run("mlp", "--batch", "4", "--dp", "2",
                                                          "--framework", "pytorch")
    traced = run("vit-b-like", "--image-res", "32", "--trace", "--dp", "2", "--zero", "1",
                 "--framework", "pytorch", "--optimizer", "adam:for-loop")
    assert traced["allocator.ddp_grad_buckets"] == traced["allocator.gradient"]
    # DeepSpeed and Megatron step Adam with their own fused kernel: not given, it is priced
    # (a given other one is refused); DeepSpeed steps SGD as given, Megatron its fused one
    for framework in ("deepspeed", "megatron"):
        job = ["--batch", "4", "--dp", "2", "--framework", framework]
        assert run("mlp", *job) == run("mlp", *job, "--optimizer", "adam:fused")
        assert run("mlp", *job, "--optimizer", "sgd") == run("mlp", *job, "--optimizer",
                                                           "sgd:fused")
    assert run("mlp", "--batch", "4", "--optimizer", "sgd:for-loop", "--framework",
               "deepspeed")["verdict"] == "fits"
    assert run("vit-b-like", "--image-res", "32", "--trace", *DEEPSPEED_STEP, "--optimizer",
               "adamw:fused") == run("vit-b-like", "--image-res", "32", "--trace",
                                     *DEEPSPEED_STEP)


def test_memory_cli_prices_torch_ddps_buffers_beyond_one_rank_on_both_paths(capsys):
    """Beyond one rank the analytical path priced no framework's data-parallel buffers with
    --framework not given, though its default is pytorch: `--dp 8` was one rank's prediction,
    under what torch DDP allocates (its gradient buckets, NCCL's buffers). Both paths price
    them by one implementation (device.grad_buffers, device.nccl_bytes): the same bytes."""
    import json

    from predictors.cli import main
    from predictors.memory.device import nccl_bytes

    def run(*argv):
        assert main(["memory", "--model", "vit-b-like", "--image-res", "32", "--json",
                     *argv]) in (0, 2, 3)
        return json.loads(capsys.readouterr().out)

    one, dp8 = run("--batch", "4"), run("--batch", "4", "--dp", "8")
    traced = run("--batch", "4", "--dp", "8", "--trace")
    buckets = traced["allocator.ddp_grad_buckets"]
    assert dp8["analytical.ddp_grad_buckets"] == buckets > 0
    assert dp8["nccl_buffers"] == traced["nccl_buffers"] == nccl_bytes(8) > one["nccl_buffers"]
    assert dp8["max_memory_reserved"] == one["max_memory_reserved"] + buckets
    assert dp8["device_used"] == one["device_used"] + buckets + nccl_bytes(8)
    assert dp8["usable"] == one["usable"] - nccl_bytes(8)  # outside the allocator
    # ZeRO 1 (torch's ZeroRedundancyOptimizer) keeps DDP's buckets (2/3: refused, below)
    assert run("--batch", "4", "--dp", "8", "--zero", "1")["analytical.ddp_grad_buckets"] == (
        buckets)
    # tensor parallelism: each rank buckets its 1/tp of the gradients
    tp2 = run("--strategy", "dp8tp2pp1")
    assert tp2["analytical.ddp_grad_buckets"] == pytest.approx(buckets / 2, rel=0.01)


@pytest.mark.parametrize("zero", [2, 3])
def test_memory_refuses_torch_beyond_zero_1_on_every_path(zero, capsys):
    """torch's ZeroRedundancyOptimizer is ZeRO-1: at --zero 2 the traced path kept every
    gradient and dropped DDP's buckets (an MLP over 8 ranks 25 MiB below its zero-1 price), the
    analytical one sharded the gradients (LLaMA-7B bf16-mixed over 8 ranks: 37.1 GB reserved
    against 71.9 at zero 1), and at 3 priced DeepSpeed's stage 3 as torch's; sharding gradients
    in PyTorch is FSDP, not modelled. Refused on both paths and by the CLI with one message
    (device.unmodelled_zero)."""
    from predictors.cli import main
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import ShardingError
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    message = (f"zero={zero} with framework='pytorch' (--zero {zero} --framework pytorch): "
               "torch DDP shards optimizer states only (zero 1, torch's "
               "ZeroRedundancyOptimizer); sharding gradients in PyTorch is its FSDP, which is "
               "not modelled; choose zero 0 or 1, or framework 'deepspeed' for its ZeRO 2/3")
    dp8 = ParallelStrategy(8, 1, 1)
    options = TrainingOptions.for_zero_stage(zero, framework="pytorch")
    with pytest.raises(ShardingError) as analytical:
        predict_peak_memory("llama-7b-like", dp8, options, "bf16-mixed")
    mlp = MlpSpec(64, (32,), 10)
    with pytest.raises(ShardingError) as traced:
        predict_module_memory(mlp.build, *mlp.example(4), strategy=dp8, options=options)
    assert str(analytical.value) == str(traced.value) == message
    for model in (["llama-7b-like"], ["mlp"], ["vit-b-like", "--trace"]):
        assert main(["memory", "--model", *model, "--dp", "8", "--zero", str(zero)]) == 1
        assert capsys.readouterr().err == f"error: ModelSpecError: {message}\n"
    # DeepSpeed's ZeRO 2/3 stays priced
    assert predict_peak_memory("llama-7b-like", dp8, TrainingOptions.for_zero_stage(
        zero, framework="deepspeed"), "bf16-mixed").peak_reserved > 0


def test_memory_api_prices_torch_ddps_buffers_beyond_one_rank_and_no_other_frameworks():
    """Only framework pytorch adds DDP's gradient buckets beyond one rank; CONA's memory filter
    (megatron_cona.candidates.PredictorMemory: Megatron's options) meets Megatron's gradient
    buffer at every dp (test_memory_parallel), the LLaVA outcomes (DeepSpeed's ZeRO-3) its
    own buckets (the next test); NCCL's buffers are every framework's."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.device import nccl_bytes
    from predictors.spec import DEFAULT_OPTIONS

    dp8 = ParallelStrategy(8, 2, 2, micro_batch=1, global_batch=16)
    one = ParallelStrategy(1, 2, 2, micro_batch=1, global_batch=2)
    for options in (DEFAULT_OPTIONS, TrainingOptions.for_zero_stage(3, framework="deepspeed")):
        p = predict_peak_memory("llama-7b-like", dp8, options, "bf16-mixed")
        assert "ddp_grad_buckets" not in p.components
        assert ("megatron_grad_buffer" in p.components) == (options.framework == "megatron")
    # no ZeRO: dp changes nothing a rank holds but its data-parallel communicator
    assert predict_peak_memory("llama-7b-like", dp8).device_total == predict_peak_memory(
        "llama-7b-like", one).device_total + nccl_bytes(8)
    torch_ddp = predict_peak_memory("llama-7b-like", dp8, TrainingOptions(framework="pytorch"))
    assert torch_ddp.components["ddp_grad_buckets"] > 0


@pytest.mark.parametrize("framework", ["torchtitan", "llm-foundry", "deepspeed"])
def test_memory_api_refuses_a_framework_whose_buffers_it_does_not_price_as_the_cli_does(
        framework, capsys):
    """Beyond one rank the CLI refused a framework whose data-parallel buffers the analytical
    model does not price (torchtitan's FSDP2, LLM Foundry's FSDP1 through Composer, DeepSpeed
    but at its ZeRO 2/3 step with fp32 masters); the API priced it as one rank's step plus
    NCCL's buffers, none of the framework's own (torchtitan over dp 8 was one rank's
    prediction + 288 MiB). One rule (device.unpriced_framework), one message naming the field
    and the flag; one rank is priced as before."""
    from predictors.cli import main
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import ShardingError

    options = TrainingOptions(framework=framework)
    with pytest.raises(ShardingError) as api:
        predict_peak_memory("llama-7b-like", ParallelStrategy(8, 1, 1, global_batch=8), options,
                            "bf16-mixed")
    assert str(api.value).startswith(f"framework='{framework}' at dp=8 (--framework "
                                     f"{framework} --dp 8): beyond one rank")
    assert main(["memory", "--model", "llama-7b-like", "--dp", "8", "--framework", framework,
                 "--precision", "bf16-mixed"]) == 1
    assert capsys.readouterr().err == f"error: ModelSpecError: {api.value}\n"
    assert predict_peak_memory("llama-7b-like", options=options).peak_reserved > 0


def test_memory_api_prices_deepspeeds_buckets_by_the_traced_paths_rule():
    """The analytical path priced DeepSpeed's ZeRO step but not its buckets, which the traced
    path prices (device.deepspeed_buckets): ZeRO 2/3 allocate the contiguous-gradient (ipg)
    buffer at the full reduce_bucket_size (5e8 elements, 954 MiB in bf16; two with
    overlap_comm at stage 2), whatever the model, one rank included (DeepSpeed's ZeRO
    optimizer runs there too). One rule on both paths, in the reserved bytes."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import ShardingError
    from predictors.memory.device import CommBuffers
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    def job(zero, dp=8, **kw):
        return predict_peak_memory("llama-7b-like", ParallelStrategy(dp, 1, 1, global_batch=dp),
                                   TrainingOptions.for_zero_stage(zero, framework="deepspeed"),
                                   "bf16-mixed", **kw)

    bucket = int(5e8 * 2)  # reduce_bucket_size elements of bf16
    small = CommBuffers(reduce_bucket=1e6)
    for zero, n in ((2, 1), (3, 1)):  # overlap_comm: off at stage 2, on (one buffer) at 3
        p = job(zero)
        assert p.components["ds_reduce_bucket"] == n * bucket
        assert p.peak_reserved - job(zero, buffers=small).peak_reserved == n * (bucket - 2e6)
    assert job(2, buffers=CommBuffers(overlap_comm=True)).components["ds_reduce_bucket"] == (
        2 * bucket)
    assert job(3, dp=1).components["ds_reduce_bucket"] == bucket  # one rank too
    # the traced path's bytes, by the same rule (an fp32 MLP: 4 B elements), at one rank too
    mlp = MlpSpec(64, (32,), 10)
    for dp in (1, 8):
        traced = predict_module_memory(mlp.build(), *mlp.example(4), precision="fp32",
                                       strategy=ParallelStrategy(dp, 1, 1),
                                       options=TrainingOptions.for_zero_stage(
                                           2, framework="deepspeed"))
        assert traced.inside_allocator["ds_reduce_bucket"] == 5e8 * 4
    with pytest.raises(ShardingError, match=r"buffers.prefetch_bucket=1e\+06: the analytical"):
        job(3, buffers=CommBuffers(prefetch_bucket=1e6))


@pytest.mark.parametrize("options", [TrainingOptions(distributed_optimizer=True),
                                     TrainingOptions.for_zero_stage(3, framework="deepspeed"),
                                     TrainingOptions(framework="pytorch")])
def test_memory_prices_one_nccl_communicator_per_parallel_group_of_every_framework(options):
    """NCCL's buffers (cudaMalloc, outside the caching allocator) were priced for torch DDP's
    data-parallel communicator only: Megatron's and DeepSpeed's data-parallel communicators,
    and the tensor- and pipeline-parallel ones Megatron-Core creates
    (parallel_state.initialize_model_parallel), were missing from the device total, 288 MiB
    each at the default 16 channels (LLaMA-7B over dp 8, tp 2, pp 2: 864 MiB). Each group of
    more than one rank is priced once, by one rule (device.nccl_communicators), and named."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.device import nccl_bytes

    each = nccl_bytes(8)
    assert each == 288 * 2**20  # 16 channels x 2 x 4 MiB x (1 + 1/8 + 9/8)
    for strategy, groups in ((ParallelStrategy(8, 2, 2, global_batch=16), {"dp", "tp", "pp"}),
                             (ParallelStrategy(1, 2, 1), {"tp"}),
                             (ParallelStrategy(1, 1, 4, global_batch=4), {"pp"}),
                             (ParallelStrategy(1, 1, 1), set())):
        if options.zero_stage and strategy.dp == 1:
            continue  # nothing to shard (and DeepSpeed's walk wants dp ranks)
        if options.framework == "megatron":  # its distributed optimizer's gradient statistics,
            # the model-parallel group of train_step and the world group (the next tests;
            # LLaMA's embeddings are untied)
            groups = groups | {"dist_opt", "world"} | ({"mp"} if strategy.tp * strategy.pp > 1
                                                       else set())
        elif options.framework == "deepspeed":  # the world group beside its cloned dp group
            groups = groups | {"world"}
        p = predict_peak_memory("llama-7b-like", strategy, options, "bf16-mixed")
        assert p.nccl == {f"nccl_{g}": each for g in groups}
        assert p.device_used == p.peak_reserved + p.context_bytes + each * len(groups)
        d = p.as_dict()
        assert d["nccl_buffers"] == each * len(groups)
        assert {k: v for k, v in d.items() if k.startswith("nccl_") and k != "nccl_buffers"} \
            == p.nccl
        for g in groups:
            assert f"NCCL {g} communicator" in p.format()


def test_memory_prices_megatrons_gradient_statistics_and_embedding_communicators():
    """Megatron-Core 0.16 runs collectives on two more groups than dp, tp and pp, each its own
    NCCL communicator (288 MiB at the default 16 channels) that was missing from the device
    total: the optimizer all-reduces the gradient norm (every step, whatever --clip-grad) and
    fp16's found-inf over its grad-stats group, the model-parallel group of tp x pp ranks ('mp') or,
    with the distributed optimizer, the intra-distributed-optimizer instance group of every
    rank ('dist_opt'); and with tied word embeddings the first and last pipeline stage
    all-reduce the shared weight over the embedding group ('embd'). Priced by one rule
    (device.nccl_communicators) on both paths, Megatron's only."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.device import nccl_bytes, nccl_communicators
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec
    from predictors.spec import DEFAULT_OPTIONS

    each = nccl_bytes(2)
    s = ParallelStrategy(2, 2, 2, global_batch=4)
    distributed = TrainingOptions(distributed_optimizer=True)

    def groups(model, options, strategy=s):
        p = predict_peak_memory(model, strategy, options, "bf16-mixed")
        assert set(p.nccl.values()) <= {each}
        assert p.device_used == p.peak_reserved + p.context_bytes + each * len(p.nccl)
        return {k.removeprefix("nccl_") for k in p.nccl}

    # Qwen2-1.5B ties its embeddings: the stage predicted (first or last) holds the group
    # (and the world group of every rank: the test after next)
    assert groups("qwen2-1.5b-like", DEFAULT_OPTIONS) == {"dp", "tp", "pp", "mp", "embd",
                                                          "world"}
    # train_step all-reduces over the model-parallel group whatever the optimizer (the next
    # test but one)
    assert groups("qwen2-1.5b-like", distributed) == {"dp", "tp", "pp", "dist_opt", "embd",
                                                      "world", "mp"}
    assert groups("llama-7b-like", DEFAULT_OPTIONS) == {"dp", "tp", "pp", "mp", "world"}
    assert groups("llama-7b-like", DEFAULT_OPTIONS, ParallelStrategy(8, 1, 1)) == {"dp",
                                                                                   "world"}
    assert groups("llama-7b-like", distributed, ParallelStrategy(8, 1, 1)) == {
        "dp", "dist_opt", "world"}
    # torch DDP and DeepSpeed run none of Megatron's groups
    assert groups("qwen2-1.5b-like", TrainingOptions(framework="pytorch")) == {"dp", "tp", "pp"}
    # a middle stage holds no copy of the embeddings: no embedding communicator
    pp4 = ParallelStrategy(1, 1, 4, global_batch=4)
    assert set(nccl_communicators(pp4, DEFAULT_OPTIONS)) == {"nccl_pp", "nccl_mp",
                                                             "nccl_world"}
    assert set(nccl_communicators(pp4, DEFAULT_OPTIONS, embedding_stage=True)) == {
        "nccl_pp", "nccl_mp", "nccl_embd", "nccl_world"}
    # the traced path (data parallelism only): the distributed optimizer's group over dp
    mlp = MlpSpec(64, (32,), 10)
    traced = predict_module_memory(mlp.build, *mlp.example(4), strategy=ParallelStrategy(8, 1, 1),
                                   options=replace(distributed, framework="megatron"))
    assert {k for k in traced.outside_allocator if k.startswith("nccl")} == {
        "nccl_dp", "nccl_dist_opt", "nccl_world"}


def test_memory_prices_megatrons_model_parallel_communicator_with_the_distributed_optimizer():
    """Megatron-LM's train_step all-reduces the step's success and the gradient norm over the
    model-parallel group (tp x pp ranks) every step (training.py: logical_and_across_model_
    parallel_group, reduce_max_stat_across_model_parallel_group), whatever the optimizer's
    gradient-statistics group: with the distributed optimizer that group is the
    intra-distributed-optimizer one, and the model-parallel communicator (288 MiB) was dropped
    from the device total. Both are priced; without tp or pp there is no model-parallel
    group."""
    from predictors.memory.device import nccl_bytes, nccl_communicators

    distributed = TrainingOptions(distributed_optimizer=True)
    for s in (ParallelStrategy(2, 2, 1), ParallelStrategy(2, 1, 2, global_batch=4)):
        groups = nccl_communicators(s, distributed)
        assert groups["nccl_mp"] == groups["nccl_dist_opt"] == nccl_bytes(2)
    assert "nccl_mp" not in nccl_communicators(ParallelStrategy(8, 1, 1), distributed)


def test_memory_prices_megatrons_world_group_communicator():
    """Megatron-LM runs collectives on torch's default (world) process group besides
    Megatron-Core's groups: initialize.py's _compile_dependencies ends with a
    torch.distributed.barrier() on it and training.py's pretrain all-reduces the start time
    over it, so every rank holds its NCCL communicator (288 MiB at the default 16 channels),
    which was missing from Megatron's device total. It is a communicator of its own even where
    another group holds the same ranks (tp = pp = 1: dp, world and the distributed optimizer's
    group are three); at one rank there is none. Not torch DDP's: its data-parallel group is
    the default one (DeepSpeed's: the next test but one)."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.device import nccl_bytes, nccl_communicators
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec
    from predictors.spec import DEFAULT_OPTIONS

    s = ParallelStrategy(2, 2, 2, global_batch=4)
    assert nccl_communicators(s, DEFAULT_OPTIONS)["nccl_world"] == nccl_bytes(8)
    assert "nccl_world" not in nccl_communicators(ParallelStrategy(1, 1, 1), DEFAULT_OPTIONS)
    assert "nccl_world" not in nccl_communicators(s, TrainingOptions(framework="pytorch"))
    p = predict_peak_memory("llama-7b-like", s, DEFAULT_OPTIONS, "bf16-mixed")
    assert p.nccl["nccl_world"] == nccl_bytes(8)
    assert "NCCL world communicator" in p.format()
    # the traced path: data parallelism only, the world group beside the data-parallel one
    mlp = MlpSpec(64, (32,), 10)
    traced = predict_module_memory(mlp.build, *mlp.example(4), strategy=ParallelStrategy(8, 1, 1),
                                   options=TrainingOptions(framework="megatron"))
    assert traced.outside_allocator["nccl_world"] == traced.outside_allocator["nccl_dp"] \
        == nccl_bytes(8)


def test_memory_traced_path_prices_the_data_parallel_communicator_once_per_framework():
    """The traced paths price the data-parallel communicator of every framework they model
    (by the same rule as the analytical path), named nccl_dp and counted once (Megatron's and
    DeepSpeed's world group beside it is a communicator of its own: the tests around it)."""
    from predictors.memory.device import nccl_bytes
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    mlp = MlpSpec(64, (32,), 10)
    dp8 = ParallelStrategy(8, 1, 1)
    for options in (TrainingOptions(framework="pytorch"), TrainingOptions(framework="megatron"),
                    TrainingOptions.for_zero_stage(2, framework="deepspeed")):
        p = predict_module_memory(mlp.build, *mlp.example(4), strategy=dp8, options=options)
        outside = p.outside_allocator
        world = {"nccl_world": nccl_bytes(8)} if options.framework != "pytorch" else {}
        assert {k: v for k, v in outside.items() if k.startswith("nccl")} == {
            "nccl_dp": nccl_bytes(8), **world}
        nccl = nccl_bytes(8) * (1 + len(world))
        assert p.device_used == p.max_memory_reserved + outside["cuda_context"] + nccl
        assert p.as_dict()["nccl_buffers"] == nccl
    one = predict_module_memory(mlp.build, *mlp.example(4))
    assert set(one.outside_allocator) == {"cuda_context"} and one.as_dict()["nccl_buffers"] == 0
    # the sum is of the communicators the prediction holds, not a second pricing of them
    p.outside_allocator["nccl_dp"] += 1
    assert p.as_dict()["nccl_buffers"] == p.nccl_bytes == nccl + 1


def test_memory_prices_deepspeeds_world_group_beside_its_cloned_data_parallel_group():
    """Without an mpu DeepSpeed's data-parallel group is a clone of the world group
    (deepspeed/utils/groups.py, _get_data_parallel_group -> _clone_world_group: a new_group
    of every rank, its own ProcessGroupNCCL), over which the engine broadcasts the model and
    reduces the gradients (nccl_dp), while torch's default group runs ZeRO-3's parameter
    all-gathers every step (partition_parameters.py Init: ds_process_group =
    dist.get_world_group() without a data_parallel_group) and, at every stage,
    save_checkpoint's barrier and the checkpoint tag's all-reduce: two communicators over the
    same ranks (v0.9.5, v0.12.6, v0.16). The world one was missing, 288 MiB on every DeepSpeed
    job beyond one rank; both paths price it by Megatron's rule (device.nccl_communicators)."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.device import nccl_bytes, nccl_communicators
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec

    dp8 = ParallelStrategy(8, 1, 1)
    for zero in (0, 1, 2, 3):
        options = TrainingOptions.for_zero_stage(zero, framework="deepspeed")
        assert nccl_communicators(dp8, options) == {"nccl_dp": nccl_bytes(8),
                                                    "nccl_world": nccl_bytes(8)}
        assert nccl_communicators(ParallelStrategy(1, 1, 1), options) == {}
    p = predict_peak_memory("llama-7b-like", dp8,
                            TrainingOptions.for_zero_stage(3, framework="deepspeed"), "bf16-mixed")
    assert p.nccl == {"nccl_dp": nccl_bytes(8), "nccl_world": nccl_bytes(8)}
    assert "NCCL world communicator" in p.format()
    mlp = MlpSpec(64, (32,), 10)
    traced = predict_module_memory(mlp.build, *mlp.example(4), strategy=dp8,
                                   options=TrainingOptions(framework="deepspeed"))
    assert traced.outside_allocator["nccl_world"] == traced.outside_allocator["nccl_dp"] \
        == nccl_bytes(8)


def test_memory_cli_prices_megatron_beyond_one_rank_now_that_its_nccl_buffers_are(capsys):
    """The analytical path refused --framework megatron beyond one rank because it priced
    Megatron's gradient buffer but not its NCCL buffers; with those priced every buffer of
    Megatron's is, and it prices the job (CONA's memory filter always did, through the API)."""
    import json

    from predictors.cli import main
    from predictors.memory.device import nccl_bytes

    assert main(["memory", "--model", "vit-b-like", "--image-res", "32", "--json",
                 "--framework", "megatron", "--dp", "8", "--zero", "1"]) in (0, 2, 3)
    out = json.loads(capsys.readouterr().out)
    # and the distributed optimizer's gradient statistics and the world group over every
    # rank (the next tests)
    assert out["nccl_dp"] == out["nccl_dist_opt"] == out["nccl_world"] \
        == out["nccl_buffers"] / 3 == nccl_bytes(8)
    assert out["analytical.megatron_grad_buffer"] > 0


def test_memory_cli_prices_a_preset_at_its_own_2048_tokens_unless_seq_is_given(capsys):
    """--seq's default moved from 2048 to None (not given): a preset is still priced at 2048."""
    import json

    from predictors.cli import main
    from predictors.memory.presets import get_preset

    assert get_preset("llama-7b-like").text.seq_length == 2048

    def run(*argv):
        assert main(["memory", "--model", "llama-7b-like", "--json", *argv]) in (0, 2, 3)
        return json.loads(capsys.readouterr().out)

    assert run() == run("--seq", "2048") != run("--seq", "4096")


def test_memory_cli_judges_a_preset_on_the_card_it_names(capsys):
    """--device on a preset sets the capacity (it was judged on 80 GiB whatever the card) and
    the generation's overheads: an A100-80GB is not Hopper."""
    import json

    from predictors.cli import main
    from predictors.memory.allocator import GiB

    def run(*argv):
        main(["memory", "--model", "llama-7b-like", "--json", *argv])
        return json.loads(capsys.readouterr().out)

    assert run("--device", "a100-40gb")["capacity"] == 40 * GiB
    a100, h100 = run("--device", "a100-80gb"), run("--device", "h100-80gb")
    assert a100["capacity"] == h100["capacity"] == 80 * GiB
    assert a100["cuda_context"] != h100["cuda_context"]
    assert run("--device", "a100-40gb", "--capacity-gib", "24")["capacity"] == 24 * GiB


def test_memory_prices_the_pipeline_schedules_gradient_tensors():
    """Megatron-Core 0.16's 1F1B schedule holds, besides the in-flight activations (whose
    first layer's input is the forward receive), the output gradient it receives from the next
    stage on every stage but the last (p2p_communication._communicate's torch.empty, held by
    the schedule's output_tensor_grad through the backward) and, on every stage but the first,
    the previous backward's input gradient (held by input_tensor_grad until the next
    backward_step returns) wherever the stage runs more micro-batches than in flight; each
    (seq / cp [/ tp with sequence parallelism], micro-batch, hidden) in the weights' dtype
    (pipeline_dtype). Neither was priced at pp > 1."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.config import Step
    from predictors.memory.device import pipeline_buffers
    from predictors.spec import DEFAULT_OPTIONS

    s = ParallelStrategy(1, 2, 4, micro_batch=2, global_batch=16)  # 8 micro-batches
    cfg = Step(s, DEFAULT_OPTIONS, "bf16-mixed")
    size = 2048 * 2 * 4096 * 2
    both = {"pp_output_grad_recv": size, "pp_input_grad": size}
    assert pipeline_buffers(cfg, 2048, 4096, 0, 4) == {"pp_output_grad_recv": size}
    assert pipeline_buffers(cfg, 2048, 4096, 1, 3) == both
    assert pipeline_buffers(cfg, 2048, 4096, 3, 1) == {"pp_input_grad": size}
    # no more micro-batches than in flight: the stage's peak backward is its first
    few = Step(replace(s, global_batch=4), DEFAULT_OPTIONS, "bf16-mixed")
    assert pipeline_buffers(few, 2048, 4096, 1, 2) == {"pp_output_grad_recv": size}
    sp = Step(s, replace(DEFAULT_OPTIONS, sequence_parallel=True), "bf16-mixed")
    assert pipeline_buffers(sp, 2048, 4096, 1, 3) == {k: v // 2 for k, v in both.items()}
    fp32 = Step(s, DEFAULT_OPTIONS, "fp32")  # pipeline_dtype: the weights' dtype
    assert pipeline_buffers(fp32, 2048, 4096, 1, 3) == {k: v * 2 for k, v in both.items()}
    assert pipeline_buffers(Step(ParallelStrategy(1, 2, 1), DEFAULT_OPTIONS, "bf16-mixed"),
                            2048, 4096, 0, 1) == {}
    # the API holds them at the predicted stage's peak
    p = predict_peak_memory("llama-7b-like", s, DEFAULT_OPTIONS, "bf16-mixed")
    t = p.model.text
    p2p = pipeline_buffers(p.step, t.seq_length, t.hidden_size, p.stage,
                           p.inflight_microbatches)
    assert p2p and {k: p.components[k] for k in p2p} == p2p
    assert p.peak_allocated_analytical == sum(p.components.values())
