"""TP and PP in the memory API (Megatron-Core layouts, per rank) and CONA's admission using it."""

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
    pp4 = predict_peak_memory(MODEL, ParallelStrategy(1, 1, 4, global_batch=8),
                              precision="bf16-mixed")
    stage = predict_peak_memory(MODEL, ParallelStrategy(1, 1, 4), precision="bf16-mixed")
    assert pp4.inflight_microbatches == 4 and stage.inflight_microbatches == 1
    assert pp4.components["activations"] == 4 * stage.components["activations"]
    assert pp4.components["parameters"] == stage.components["parameters"]
    with pytest.raises(ShardingError, match="pp=5"):
        predict_peak_memory(MODEL, ParallelStrategy(1, 1, 5))
    with pytest.raises(ShardingError, match="tp=3"):
        predict_peak_memory(MODEL, ParallelStrategy(1, 3, 1))


def test_uneven_pipeline_split_prices_the_first_stages_own_depth():
    """Megatron's --decoder-first-pipeline-num-layers: the first stage holds its own depth (30
    layers as 6 + 2 x 10 + 4 on pp=4 where pp does not divide the depth: accepted), with the
    same in-flight micro-batches as an even split."""
    from dataclasses import replace

    from predictors.spec import StrategyError

    deep = as_memory_model(MODEL)
    model30 = deep.with_layers(None, 30)
    uneven = ParallelStrategy(1, 1, 4, 1, 8, first_stage_layers=6, last_stage_layers=4)
    got = predict_peak_memory(model30, uneven, precision="bf16-mixed")
    even6 = predict_peak_memory(deep.with_layers(None, 24), ParallelStrategy(1, 1, 4, 1, 8),
                                precision="bf16-mixed")
    # the first stage of both holds 6 layers and 4 micro-batches
    assert got.components == even6.components and got.inflight_microbatches == 4
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
