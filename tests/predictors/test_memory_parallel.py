"""TP and PP in the memory API (Megatron-Core layouts, per rank) and CONA's admission using it."""

import argparse

import pytest

from predictors.memory.api import per_rank_components, predict_peak_memory
from predictors.memory.config import ShardingError, Step
from predictors.memory.factorize import factorize
from predictors.memory.overheads import HOPPER
from predictors.memory.phases import trainable_params, walk_phases
from predictors.memory.presets import as_memory_model
from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec

MODEL = "llama-7b-like"  # 32 layers, hidden 4096, 32 heads


def test_tp_splits_states_not_the_context():
    one = predict_peak_memory(MODEL, precision="bf16-mixed")
    tp4 = predict_peak_memory(MODEL, ParallelStrategy(1, 4, 1), precision="bf16-mixed")
    for k in ("parameters", "optimizer_states"):
        assert tp4.components[k] == one.components[k] // 4
    # activations: (10 + 24/4) / 34 of a layer's (flash attention: no s x s scores)
    assert tp4.components["activations"] == int(one.components["activations"] * 16 / 34)
    assert tp4.context_bytes == one.context_bytes  # per process, never divided
    # what TP divides is inside the allocator; the device total keeps one whole context
    assert tp4.device_total - tp4.context_bytes < (one.device_total - one.context_bytes) / 2


def test_pp_first_stage_holds_inflight_microbatches():
    """Under 1F1B with 8 micro-batches the first of 4 stages holds 4 in flight, its peak the
    largest; alone (pp = 1, one micro-batch) its part of the model holds a quarter of that."""
    pp4 = predict_peak_memory(MODEL, ParallelStrategy(1, 1, 4, global_batch=8),
                              precision="bf16-mixed")
    first = as_memory_model(MODEL).pipeline_stage(8, first=True, last=False)
    stage = predict_peak_memory(first, precision="bf16-mixed")
    assert pp4.stage == 0 and pp4.inflight_microbatches == 4
    assert stage.inflight_microbatches == 1
    assert pp4.components["activations"] == 4 * stage.components["activations"]
    assert pp4.components["parameters"] == stage.components["parameters"]
    with pytest.raises(ShardingError, match="pp=5"):
        predict_peak_memory(MODEL, ParallelStrategy(1, 1, 5))
    with pytest.raises(ShardingError, match="tp=3"):
        predict_peak_memory(MODEL, ParallelStrategy(1, 3, 1))


def test_uneven_pipeline_split_prices_each_stages_own_depth():
    """Megatron's --decoder-first/last-pipeline-num-layers: each stage holds its own depth (30
    layers as 6 + 2 x 10 + 4 on pp=4 where pp does not divide the depth: accepted). With 8
    micro-batches the second stage, 10 layers and 3 in flight, outgrows the first (6 layers,
    the embedding, 4 in flight): it is the one predicted, its part of the model priced as on
    one GPU with 3 micro-batches' activations."""
    from dataclasses import replace

    from predictors.spec import StrategyError

    deep = as_memory_model(MODEL)
    model30 = deep.with_layers(None, 30)
    uneven = ParallelStrategy(1, 1, 4, 1, 8, first_stage_layers=6, last_stage_layers=4)
    got = predict_peak_memory(model30, uneven, precision="bf16-mixed")
    middle = predict_peak_memory(deep.pipeline_stage(10, first=False, last=False),
                                 precision="bf16-mixed")
    assert (got.stage, got.inflight_microbatches, got.model.text.num_layers) == (1, 3, 10)
    assert got.components["parameters"] == middle.components["parameters"]
    assert got.components["activations"] == 3 * middle.components["activations"]
    with pytest.raises(ShardingError, match="pp=4"):
        predict_peak_memory(model30, replace(uneven, first_stage_layers=None,
                                             last_stage_layers=None))
    with pytest.raises(StrategyError, match="first_stage_layers=7"):
        predict_peak_memory(model30, replace(uneven, first_stage_layers=7))


def test_per_rank_components_by_hand():
    comps = {"parameters": 800, "gradients": 400, "optimizer_states": 1600, "activations": 340,
             "transient": 80, "inputs": 10, "workspace": 32}  # fmt: skip
    out = per_rank_components(comps, tp=2, inflight=3, activation_share=22 / 34)
    assert out == {"parameters": 400, "gradients": 200, "optimizer_states": 800,
                   "activations": 660, "transient": 40, "inputs": 10, "workspace": 32}


# as CONA's vTrain case (megatron_cona.lawsim.clock): unfused attention, the peak where the
# backward starts, before any gradient
GPT_1_3B = TransformerSpec("gpt", 24, 2048, 16, 1024, 50257, tied_embeddings=True,
                           attention="unfused")


def test_megatron_gradient_buffer_is_held_full_size_in_every_phase_in_its_dtype():
    """Megatron-Core's DDP wrapper allocates a main_grad buffer for every trainable parameter
    when it wraps the model, full size under the distributed optimizer, fp32 at bf16 weights
    and fp16 at fp16 ones, in place of param.grad. The walk held gradients only as the
    backward made them, in the weights' dtype: CONA's filter (Megatron's options) priced none
    of the buffer at this peak before the first gradient (GPT-3 1.3B bf16-mixed on 8 ranks
    with the distributed optimizer: 4.9 GiB of 11 short). Priced beyond the residual model."""
    megatron = TrainingOptions(distributed_optimizer=True)
    torch_ddp = TrainingOptions(distributed_optimizer=True, framework="pytorch")
    dp8 = ParallelStrategy(8, 1, 1, micro_batch=1, global_batch=64)
    n = trainable_params(factorize(as_memory_model(GPT_1_3B), Step(dp8, megatron)))
    for precision, width in (("bf16-mixed", 4), ("fp16-mixed", 2)):
        mg = predict_peak_memory(GPT_1_3B, dp8, megatron, precision)
        pt = predict_peak_memory(GPT_1_3B, dp8, torch_ddp, precision)
        assert mg.components["megatron_grad_buffer"] == n * width
        assert mg.components["gradients"] == pt.components["gradients"] == 0  # none made yet
        ddp = pt.components["ddp_grad_buckets"]  # beside the gradients, in their dtype
        assert ddp == n * 2
        assert mg.peak_allocated_analytical == pt.peak_allocated_analytical - ddp + n * width
        assert mg.peak_reserved == pt.peak_reserved - ddp + n * width
        tp2 = ParallelStrategy(4, 2, 1, micro_batch=1, global_batch=32)
        assert predict_peak_memory(GPT_1_3B, tp2, megatron, precision).components[
            "megatron_grad_buffer"] == n * width // 2
    # the walk: the buffer is live in the forward, and the optimizer steps it (fp32) rather
    # than fp32 gradients made beside it
    spec, cfg = as_memory_model(GPT_1_3B), Step(dp8, megatron, "bf16-mixed")
    plain = walk_phases(spec, cfg, HOPPER)
    held = walk_phases(spec, cfg, HOPPER, grad_buffer={"megatron_grad_buffer": 4 * n})
    assert held.phase_peaks["forward"] == plain.phase_peaks["forward"] + 4 * n
    assert held.phase_peaks["optimizer"] <= plain.phase_peaks["optimizer"]


def test_megatron_fp16_buffer_follows_accumulate_allreduce_grads_in_fp32(capsys):
    """Megatron-LM's --accumulate-allreduce-grads-in-fp32 makes the gradient buffer fp32 at
    fp16 weights too (ddp_config.grad_reduce_in_fp32); it was priced fp16 whatever the job
    said: GPT-3 1.3B fp16-mixed on 8 ranks 2.44 GiB short. The flag is an option of the job
    (TrainingOptions), off as Megatron-LM's is, and every consumer reads it there: the buffer
    (grad_buffers), the optimizer's cast (none from an fp32 buffer: megatron_step_copy), the
    analytical and traced paths and the CLI; --bf16 turns it on in Megatron-LM whatever is
    given, so at bf16-mixed it changes nothing. Another framework has no such flag: refused."""
    import json

    from predictors.cli import main
    from predictors.memory.device import megatron_step_copy
    from predictors.memory.module import predict_module_memory
    from predictors.memory.simple import MlpSpec
    from predictors.spec import StrategyError
    from predictors.spec.engines import from_megatron_args, megatron_args

    on = TrainingOptions(distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True)
    off = TrainingOptions(distributed_optimizer=True)
    dp8 = ParallelStrategy(8, 1, 1, micro_batch=1, global_batch=64)
    n = trainable_params(factorize(as_memory_model(GPT_1_3B), Step(dp8, off)))
    fp32, fp16 = (predict_peak_memory(GPT_1_3B, dp8, o, "fp16-mixed") for o in (on, off))
    assert fp32.components["megatron_grad_buffer"] == 4 * n
    assert fp16.components["megatron_grad_buffer"] == 2 * n
    assert fp32.peak_reserved == fp16.peak_reserved + 2 * n  # a backward peak: no step cast
    assert megatron_step_copy(Step(dp8, on, "fp16-mixed"), n, "fp16-mixed") == 0
    assert megatron_step_copy(Step(dp8, off, "fp16-mixed"), n, "fp16-mixed") == 4 * n // 8
    assert (predict_peak_memory(GPT_1_3B, dp8, on, "bf16-mixed").device_total
            == predict_peak_memory(GPT_1_3B, dp8, off, "bf16-mixed").device_total)
    # the traced path: an MLP's buffer, fp32 with the flag, fp16 without
    mlp = MlpSpec(64, (256,), 10)
    elements = sum(p.numel() for p in mlp.build().parameters())
    for options, width in ((on, 4), (off, 2)):
        traced = predict_module_memory(mlp.build, *mlp.example(4), optimizer="adam",
                                       precision="fp16-mixed", options=options)
        assert traced.inside_allocator["megatron_grad_buffer"] == width * elements
    # the CLI, by Megatron-LM's own flag name
    def run(*argv):
        assert main(["memory", "--model", "llama-7b-like", "--framework", "megatron",
                     "--precision", "fp16-mixed", "--json", *argv]) in (0, 2, 3)
        return json.loads(capsys.readouterr().out)["analytical.megatron_grad_buffer"]

    assert run("--accumulate-allreduce-grads-in-fp32") == 2 * run()
    # Megatron-LM's flags carry it both ways
    assert "--accumulate-allreduce-grads-in-fp32" in megatron_args(GPT_1_3B, dp8, on)
    assert "--accumulate-allreduce-grads-in-fp32" not in megatron_args(GPT_1_3B, dp8, off)
    parsed = argparse.Namespace(num_layers=24, hidden_size=2048, num_attention_heads=16,
                                seq_length=1024, micro_batch_size=1,
                                accumulate_allreduce_grads_in_fp32=True)
    assert from_megatron_args(parsed, 8)[2].accumulate_allreduce_grads_in_fp32
    message = ("accumulate_allreduce_grads_in_fp32=True is Megatron-LM's "
               "--accumulate-allreduce-grads-in-fp32, which framework='pytorch' does not run; "
               "drop it or set framework='megatron'")
    with pytest.raises(StrategyError) as refused:
        TrainingOptions(framework="pytorch", accumulate_allreduce_grads_in_fp32=True)
    assert str(refused.value) == message
    assert main(["memory", "--model", "mlp", "--accumulate-allreduce-grads-in-fp32"]) == 1
    assert capsys.readouterr().err == f"error: StrategyError: {message}\n"


def test_cona_admission_counts_per_rank_parts():
    from megatron_cona.candidates import PredictorMemory
    from predictors.spec import ParallelStrategy, TransformerSpec
    from predictors.spec.precision import get_precision

    gpt = TransformerSpec("gpt", 24, 2048, 16, 1024, 51200)
    mem = PredictorMemory(80)
    bf16 = get_precision("bf16-mixed")
    tp1 = mem.peak_bytes(gpt, ParallelStrategy(1, 1, 1, 1, 8), bf16)
    tp8 = mem.peak_bytes(gpt, ParallelStrategy(1, 8, 1, 1, 8), bf16)
    context = predict_peak_memory(MODEL, capacity_gib=80).context_bytes
    # the context is not divided: 8-way TP is more than an eighth of one GPU's total
    assert tp8 > tp1 / 8 + 0.8 * context
    # a deeper pipeline with more micro-batches in flight needs more on its first stage
    pp_few = mem.peak_bytes(gpt, ParallelStrategy(1, 1, 4, 1, 1), bf16)
    pp_full = mem.peak_bytes(gpt, ParallelStrategy(1, 1, 4, 1, 8), bf16)
    assert pp_full > pp_few


# llama-7b-like's dims (presets.LLAMA_7B): a decoder layer's q/k/v/o (4 h^2), SwiGLU MLP
# (3 h f) and two RMSNorms (2 h); the word embeddings and the untied head v h each
_H, _F, _V = 4096, 11008, 32064
_LAYER = 4 * _H * _H + 3 * _H * _F + 2 * _H
# llama-3.2-1b-like: a 128k vocabulary, tied embeddings
LLAMA_1B = TransformerSpec("llama", 16, 2048, 32, 2048, 128256, ffn_hidden_size=8192,
                           num_query_groups=8, swiglu=True, tied_embeddings=True)


def _params(prediction) -> int:
    return sum(x.params for x in factorize(prediction.model, prediction.step).layers)


def test_pp_first_stage_holds_the_embedding_and_the_last_the_head():
    """Megatron-Core's GPTModel builds the embedding on the first stage (``pre_process``), the
    final norm and output layer on the last (``post_process``): the first of 4 stages of
    llama-7b-like holds 8 layers and the embedding, 1.750B parameters, not also the head
    (1.882B); the last holds 8 layers, the final norm and the head."""
    pp4 = predict_peak_memory(MODEL, ParallelStrategy(1, 1, 4, 1, 8), precision="bf16-mixed")
    assert pp4.stage == 0
    assert _params(pp4) == 8 * _LAYER + _V * _H == 1_750_401_024
    spec = as_memory_model(MODEL)
    last = factorize(spec.pipeline_stage(8, first=False, last=True), pp4.step)
    assert sum(x.params for x in last.layers) == 8 * _LAYER + _H + _V * _H
    assert [x.name for x in last.layers][-1] == "llm.head" and last.loss_saved
    first = factorize(spec.pipeline_stage(8, first=True, last=False), pp4.step)
    assert first.layers[0].name == "llm.embed" and first.loss_saved == first.held_output == 0
    middle = spec.pipeline_stage(8, first=False, last=False)
    assert sum(x.params for x in factorize(middle, pp4.step).layers) == 8 * _LAYER
    assert middle.text.num_parameters() == 8 * (_LAYER - 2 * _H + 4 * _H)  # its own closed form


def test_pp_last_stage_with_a_large_vocabulary_is_the_one_predicted():
    """With tied embeddings the last stage keeps its own copy of the word embeddings
    (``LanguageModule.setup_embeddings_and_output_layer``) and holds the 128k-wide logits and
    the loss: at pp 2 with one micro-batch it outgrows the first and is the one predicted. With
    an uneven split that leaves the first stage 4 of the 16 layers, the first stage's rank
    alone (what was predicted, with the head and the loss on it) under-states the job."""
    h, v = LLAMA_1B.hidden_size, LLAMA_1B.vocab_size
    pp2 = predict_peak_memory(LLAMA_1B, ParallelStrategy(1, 1, 2, 1, 1), precision="bf16-mixed")
    assert (pp2.stage, pp2.inflight_microbatches, pp2.model.text.num_layers) == (1, 1, 8)
    stage = factorize(pp2.model, pp2.step)
    assert "llm.embed" not in [x.name for x in stage.layers]
    assert stage.layers[-1].params == h + v * h  # final norm + its copy of the embeddings
    spec = as_memory_model(LLAMA_1B)
    first = predict_peak_memory(spec.pipeline_stage(8, first=True, last=False),
                                precision="bf16-mixed")
    assert first.peak_reserved < pp2.peak_reserved
    assert "stage 2 of 2" in pp2.format() and pp2.as_dict()["pipeline_stage"] == 1
    uneven = predict_peak_memory(LLAMA_1B, ParallelStrategy(1, 1, 2, 1, 1, first_stage_layers=4),
                                 precision="bf16-mixed")
    assert (uneven.stage, uneven.model.text.num_layers) == (1, 12)
    first4 = predict_peak_memory(spec.with_layers(None, 4), precision="bf16-mixed")
    assert uneven.peak_reserved > 1.4 * first4.peak_reserved


def test_pp_later_stages_of_a_multimodal_model_leave_the_vision_tower_upstream():
    """A multimodal model's vision tower and projector feed the embedding, on the first stage;
    a later stage of blip2-3b-like (frozen ViT and LLM, a trainable projector) holds only text
    layers, which still save what the gradient needs on its way back to the projector."""
    spec = as_memory_model("blip2-3b-like")
    cfg = Step(ParallelStrategy(1, 1, 2, 1, 2), precision="bf16-mixed")
    first = factorize(spec.pipeline_stage(16, first=True, last=False), cfg)
    last = factorize(spec.pipeline_stage(16, first=False, last=True), cfg)
    assert {x.tower for x in first.layers} == {"vision", "projector", "llm"}
    assert {x.tower for x in last.layers} == {"llm"}
    assert all(x.saved for x in last.layers) and last.num_trainable_tensors == 0
