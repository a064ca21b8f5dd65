"""The nn.Module memory API: optimizer implementations, capacity-bounded allocator, device-level
parts, ZeRO buffers, cuDNN workspaces, the GPUMemNet rebuild and the CLI for MLPs and CNNs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from predictors.datasets.gpumemnet import load_cnn_rows, load_mlp_rows
from predictors.memory.allocator import MiB
from predictors.memory.cli import main
from predictors.memory.config import ShardingError, Step
from predictors.memory.device import CommBuffers, Sharding, get_device
from predictors.memory.gpumemnet import (
    GeneratedMLP,
    bce_loss,
    build_cnn,
    build_mlp,
    example_batch,
    smallest_network,
)
from predictors.memory.module import predict_module_memory, predict_spec_memory
from predictors.memory.overheads import CONTEXTS
from predictors.memory.presets import PRESETS, scaled
from predictors.memory.simple import CnnSpec, MlpSpec
from predictors.memory.simulate import simulate_step
from predictors.memory.verdict import Verdict
from predictors.spec import ModelSpecError, ParallelStrategy, TrainingOptions
from predictors.step import default_loss

WIDE = MlpSpec(1024, (2048, 2048), 10)  # 6.3M parameters, 25 MiB of fp32 weights
PARAM_BYTES = 4 * sum(p.numel() for p in WIDE.build().parameters())


def _predict(spec=WIDE, batch=8, **kw):
    x, y = spec.example(batch)
    return predict_module_memory(spec.build(), x, y, **kw)


def test_foreach_adam_holds_a_parameter_sized_temporary_fused_does_not():
    foreach = _predict(optimizer="adam", precision="fp32")
    fused = _predict(optimizer="adam:fused", precision="fp32")
    loop = _predict(optimizer="adam:for-loop", precision="fp32")
    # torch's _multi_tensor_adam: exp_avg_sq.sqrt() for every parameter at once
    extra = foreach.max_memory_allocated - fused.max_memory_allocated
    assert 0.95 * PARAM_BYTES <= extra <= 1.05 * PARAM_BYTES
    # the for-loop one works a parameter at a time: sqrt() and its quotient, 2 x the largest
    # parameter (2048 x 2048 fp32 = 16 MiB)
    assert loop.max_memory_allocated - fused.max_memory_allocated == pytest.approx(
        2 * 16 * MiB, rel=0.02)
    # weights + grads + 2 Adam states at the optimizer peak of the fused step
    assert fused.inside_allocator["optimizer_state"] >= 2 * PARAM_BYTES


def test_real_and_meta_modules_and_factories_give_the_same_prediction():
    x, y = WIDE.example(8)
    with torch.device("meta"):
        meta = WIDE.build()
    a = predict_module_memory(WIDE.build(), x, y)
    b = predict_module_memory(meta, x, y)
    c = predict_module_memory(WIDE.build, x, y)
    assert a.max_memory_reserved == b.max_memory_reserved == c.max_memory_reserved


def test_fp16_autocast_with_grad_scaler_still_steps_the_foreach_optimizer():
    p = _predict(precision="fp16", optimizer="adam")
    # the scaler's found-inf read answered "no inf": the Adam states were created and updated
    assert p.inside_allocator["optimizer_state"] >= 2 * PARAM_BYTES


def test_device_level_names_every_part():
    p = _predict(device="a100-40gb")
    assert p.outside_allocator == {"cuda_context": CONTEXTS["ampere"].bytes}  # one rank: no NCCL
    assert p.device_used == p.max_memory_reserved + CONTEXTS["ampere"].bytes
    assert p.max_memory_reserved >= p.max_memory_allocated
    d = p.as_dict()
    assert d["device_used"] == p.device_used and "allocator.workspace" in d
    assert d["verdict"] == "fits" and d["margin_family"] == "dense"  # no convolution
    # the shipped calibration, each side at its own coverage
    assert (d["margin_lower_coverage"], d["margin_upper_coverage"]) == (0.95, 0.99)
    assert d["margin_rows"] > 0
    own = _predict(device="a100-40gb", context_mib=500)
    assert own.device_used == p.max_memory_reserved + 500 * MiB
    with pytest.raises(ModelSpecError):
        _predict(context_mib=-1)


def test_capacity_bound_frees_cached_segments_then_ooms():
    cnn = CnnSpec((32, 64), image_res=64, classes=10)  # transient cuDNN workspaces

    def run(capacity=None):
        return _predict(cnn, batch=64, device="a100-40gb", capacity_gib=capacity)

    free = run()
    outside = sum(free.outside_allocator.values())
    slack = free.max_memory_reserved - free.max_memory_allocated
    assert slack > 20 * MiB  # cached segments beyond the live bytes
    assert free.margin.family == "conv"
    # room for the allocated peak + margin but not for the unbounded reserved peak
    room = free.margin.bounds(free.max_memory_allocated + slack // 2)[1]
    tight = run((room + outside) / 2**30)
    assert tight.verdict is Verdict.FITS and tight.segments_released > 0
    assert tight.max_memory_allocated <= tight.max_memory_reserved < free.max_memory_reserved
    over = run((free.max_memory_allocated // 2 + outside) / 2**30)
    assert over.out_of_memory and over.verdict is not Verdict.FITS


def test_deepspeed_zero_shards_and_names_its_buffers():
    one = _predict(optimizer="adam:fused")
    dp8 = ParallelStrategy(8, 1, 1)
    z2 = _predict(strategy=dp8, options=TrainingOptions.for_zero_stage(2, framework="deepspeed"))
    z3 = _predict(strategy=dp8, options=TrainingOptions.for_zero_stage(3, framework="deepspeed"))
    assert z2.optimizer.impl == "fused"  # DeepSpeed runs its own fused Adam
    # the contiguous-gradient buffer has reduce_bucket_size (5e8) fp32 elements, model or not
    assert z2.inside_allocator["ds_reduce_bucket"] == 5e8 * 4
    assert {"ds_stage3_gathered_module", "ds_prefetch_bucket"} <= set(z3.inside_allocator)
    small = _predict(strategy=dp8, options=TrainingOptions.for_zero_stage(2, framework="deepspeed"),
                     buffers=CommBuffers(reduce_bucket=1e6))
    # states and gradients sharded 8 ways, a 4 MB bucket instead of 2 GB
    assert small.max_memory_allocated < one.max_memory_allocated < z2.max_memory_allocated
    assert z2.outside_allocator["nccl_dp"] > 0
    with pytest.raises(ShardingError, match="framework='megatron'"):
        Sharding(dp8, TrainingOptions.for_zero_stage(3, framework="megatron"))
    with pytest.raises(ShardingError, match="framework='pytorch'.*FSDP, which is not modelled"):
        _predict(strategy=dp8, options=TrainingOptions.for_zero_stage(3, framework="pytorch"))
    with pytest.raises(ShardingError, match="framework='torchtitan'"):
        _predict(strategy=dp8, options=TrainingOptions(framework="torchtitan"))
    with pytest.raises(ShardingError, match="tp=pp=cp=1"):
        _predict(strategy=ParallelStrategy(4, 2, 1))


def test_deepspeed_zero_1_holds_its_contiguous_gradient_buffer_as_zero_2_does():
    """DeepSpeed's stages 1 and 2 are one optimizer class (stage_1_and_2.py): its backward
    allocates the contiguous-gradient (ipg) buffer of reduce_bucket_size elements, two with
    overlap_comm, wherever contiguous_gradients holds (on by default), stage 1 too. It was
    priced at stage 2 only: stage 1 came out 2 GB (fp32) under what DeepSpeed allocates."""
    dp8 = ParallelStrategy(8, 1, 1)
    zero1 = TrainingOptions.for_zero_stage(1, framework="deepspeed")
    z1 = _predict(strategy=dp8, options=zero1)
    assert z1.inside_allocator["ds_reduce_bucket"] == 5e8 * 4  # fp32 elements
    assert "ds_allgather_bucket" in z1.inside_allocator
    small = _predict(strategy=dp8, options=zero1, buffers=CommBuffers(reduce_bucket=1e6))
    assert z1.max_memory_reserved - small.max_memory_reserved == (5e8 - 1e6) * 4
    overlap = _predict(strategy=dp8, options=zero1, buffers=CommBuffers(overlap_comm=True))
    assert overlap.inside_allocator["ds_reduce_bucket"] == 2 * 5e8 * 4


def test_deepspeed_zero_0_holds_its_engines_allreduce_bucket():
    """At ZeRO 0 DeepSpeed's engine is the data parallelism: engine.backward's
    allreduce_gradients runs buffered_allreduce_fallback at any dp, which flattens the
    gradients, in parameter order, into new tensors of up to MEMORY_OPT_ALLREDUCE_SIZE (5e8)
    elements (a bucket passes it by one tensor: allreduce_no_retain) and all-reduces each. It was
    priced as a plain step, no bucket: here the whole model's gradients, one flat copy."""
    grads = [q.numel() for q in WIDE.build().parameters()]
    plain = _predict(optimizer="adam:fused")
    for dp in (1, 8):
        z0 = _predict(strategy=ParallelStrategy(dp, 1, 1), options=TrainingOptions(
            framework="deepspeed"))
        assert z0.inside_allocator["ds_allreduce_bucket"] == sum(grads) * 4  # fp32 gradients
        assert z0.max_memory_allocated == plain.max_memory_allocated + sum(grads) * 4
    # 5e8 elements a bucket, passed by the tensor that crosses it
    from predictors.memory.device import allreduce_bucket

    assert allreduce_bucket([3e8, 3e8, 1e8]) == 6e8
    assert allreduce_bucket([1e8] * 4) == 4e8
    assert allreduce_bucket([4e8, 2e8, 6e8, 1e8]) == 6e8


def test_deepspeed_zero_0_with_bf16_weights_holds_its_bf16_optimizers_buffers():
    """DeepSpeed at ZeRO 0 with bf16 weights wraps the optimizer in its BF16_Optimizer
    (engine.py get_data_types: fp32 gradient accumulation without ZeRO;
    _do_optimizer_sanity_check -> BFLOAT16), which allocates an fp32 gradient buffer of every
    trainable element at init, full size at any dp, keeps the bf16 .grad until the next
    backward (clear_lp_grads; the engine's step leaves them) and holds the fp32 masters and
    the optimizer's states of its 1/dp partition only (bf16_optimizer.py,
    _setup_for_real_optimizer). It was priced as a plain step: no fp32 buffer, masters and
    states whole over 8 ranks. Both paths price it by one rule (device.grad_buffers)."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.factorize import factorize
    from predictors.memory.phases import trainable_params

    n = sum(q.numel() for q in WIDE.build().parameters())
    ds0 = TrainingOptions(framework="deepspeed")
    z = {dp: _predict(strategy=ParallelStrategy(dp, 1, 1), options=ds0, precision="bf16-mixed")
         for dp in (1, 8)}
    for p in z.values():
        assert p.inside_allocator["ds_fp32_grad_buffer"] == 4 * n
        assert p.inside_allocator["ds_bf16_grads"] == 2 * n
        assert p.inside_allocator["gradient"] == 0  # the traced .grad are the buffers
    # the fp32 masters and Adam states (the trace's optimizer_state) shard over dp, as at
    # ZeRO 1 (the traced peak is the step's: its temporaries cover the shard only)
    live = z[1].inside_allocator
    assert z[1].max_memory_allocated - z[8].max_memory_allocated == (
        int(live["optimizer_state"] * 7 / 8) + int(live["temporary"] * 7 / 8))
    # fp16 weights are not BF16_Optimizer's (FP16_Optimizer's): no such buffers
    fp16 = _predict(options=ds0, precision="fp16-mixed")
    assert "ds_fp32_grad_buffer" not in fp16.inside_allocator
    # the analytical path (ZeRO 0 at one rank): both live at the backward peak, where the
    # plain step holds no gradient yet
    one = ParallelStrategy(1, 1, 1)
    ds = predict_peak_memory("qwen2-1.5b-like", one, ds0, "bf16-mixed")
    plain = predict_peak_memory("qwen2-1.5b-like", one, TrainingOptions(framework="pytorch"),
                                "bf16-mixed")
    t = trainable_params(factorize(ds.model, ds.step))
    assert ds.components["ds_fp32_grad_buffer"] == 4 * t
    assert ds.components["ds_bf16_grads"] == 2 * t
    assert ds.peak_phase == plain.peak_phase == "backward"
    assert ds.peak_reserved == plain.peak_reserved + 6 * t + ds.components["ds_allreduce_bucket"]


def test_deepspeed_zero_0_with_fp16_weights_steps_fp16_optimizers_flat_fp32_copy():
    """DeepSpeed at ZeRO 0 with fp16 weights and its FusedAdam (the fp16-mixed precision:
    DeepSpeed's "fp16" config) wraps it in FP16_Optimizer (engine.py
    _do_optimizer_sanity_check -> FP16, _configure_fp16_optimizer), whose step casts every
    fp16 .grad to fp32 in one list and concatenates it into a new flat fp32 tensor before it
    frees the fp16 ones (runtime/fp16/fused_optimizer.py, step; v0.9.5 and v0.12.6): 10 B per
    trainable element at once, where the plain step casts and frees one tensor at a time
    (about 4). Its fp32 masters and Adam states stay whole at any dp. Both paths price it by
    one rule (device.step_copy)."""
    from predictors.memory.api import predict_peak_memory
    from predictors.memory.factorize import factorize
    from predictors.memory.phases import trainable_params

    n = sum(q.numel() for q in WIDE.build().parameters())
    ds0 = TrainingOptions(framework="deepspeed")
    z = {dp: _predict(strategy=ParallelStrategy(dp, 1, 1), options=ds0, precision="fp16-mixed")
         for dp in (1, 8)}
    live = z[1].inside_allocator
    # the step's highest moment: the weights, masters, states and cuBLAS workspace, every
    # fp16 .grad (2 B), the fp32 list and the flat fp32 tensor (4 + 4 B); the engine's bucket
    assert z[1].max_memory_allocated - live["ds_allreduce_bucket"] == pytest.approx(
        live["parameter"] + live["optimizer_state"] + live["workspace"] + 10 * n, rel=0.005)
    assert z[8].max_memory_allocated == z[1].max_memory_allocated  # nothing is partitioned
    # BF16_Optimizer's step is another (its fp32 buffer), checked above
    assert z[1].max_memory_allocated > _predict(options=ds0, precision="bf16-mixed"
                                                ).max_memory_allocated
    # the analytical path (one rank): the step is now the peak, not the backward
    one = ParallelStrategy(1, 1, 1)
    ds = predict_peak_memory("qwen2-1.5b-like", one, ds0, "fp16-mixed")
    plain = predict_peak_memory("qwen2-1.5b-like", one, TrainingOptions(framework="pytorch"),
                                "fp16-mixed")
    t = trainable_params(factorize(ds.model, ds.step))
    assert (ds.peak_phase, plain.peak_phase) == ("optimizer", "backward")
    assert ds.components["gradients"] == 10 * t
    assert ds.components["optimizer_states"] == plain.components["optimizer_states"]
    bucket = ds.components["ds_allreduce_bucket"]
    assert ds.peak_reserved - bucket - plain.peak_reserved == (
        ds.peak_allocated_analytical - bucket - plain.peak_allocated_analytical)


def test_an_implementation_the_framework_does_not_run_is_refused_by_the_api_as_by_the_cli():
    """DeepSpeed and Megatron step Adam(W) with their own fused kernel: predict_module_memory
    priced an explicit ``adam:foreach`` (or an OptimizerSpec naming it) as fused without a
    word (the foreach temporary left out: 12 MiB here, its ZeRO-1 shard), where the CLI
    refused it. Both refuse it by one rule (device.unrun_impl), naming the field; named by no
    implementation, the framework's own is priced, and one it runs is priced as given."""
    from predictors.memory.optimizers import OptimizerSpec

    dp2 = ParallelStrategy(2, 1, 1)
    deepspeed = TrainingOptions.for_zero_stage(1, framework="deepspeed")
    megatron = TrainingOptions(framework="megatron")
    for optimizer, options, own in (
            ("adam:foreach", deepspeed, "DeepSpeed steps Adam with its own fused kernel"),
            (OptimizerSpec("adamw", "for-loop"), megatron,
             "Megatron steps AdamW with its own fused kernel"),
            ("sgd:foreach", megatron, "Megatron steps SGD with its own fused kernel")):
        with pytest.raises(ShardingError) as refused:
            _predict(strategy=dp2, options=options, optimizer=optimizer)
        said = optimizer if isinstance(optimizer, str) else "adamw:for-loop"
        name, impl = said.split(":")
        assert str(refused.value).startswith(
            f"optimizer '{said}' with framework={options.framework!r}: {own}")
        assert str(refused.value).endswith(
            f", which the traced path prices; give the optimizer without ':{impl}' ('{name}')")
    bare = _predict(strategy=dp2, options=deepspeed, optimizer="adam")
    assert bare.optimizer.impl == "fused"
    assert bare.max_memory_allocated == _predict(strategy=dp2, options=deepspeed,
                                                 optimizer="adam:fused").max_memory_allocated
    assert _predict(strategy=dp2, options=deepspeed, optimizer="sgd:for-loop").optimizer.impl == (
        "for-loop")  # DeepSpeed steps SGD as the script builds it
    assert _predict(optimizer="adam").optimizer.impl == "foreach"  # torch's default


def test_ddp_buckets_and_megatron_buffer_hold_every_trainable_gradient_whatever_the_peak():
    """torch DDP allocates its flat buckets when it wraps the model (the reducer's
    initialize_buckets), Megatron its main-grad buffer: each as large as every trainable
    gradient and live in every phase. They were priced at the gradients live at the traced
    peak: at this backward peak, the last layers' only."""
    dp2 = ParallelStrategy(2, 1, 1)
    model = WIDE.build()
    frozen = model[0].weight  # a frozen weight has no gradient to bucket
    frozen.requires_grad_(False)
    x, y = WIDE.example(4096)
    for framework, name in (("pytorch", "ddp_grad_buckets"),
                            ("megatron", "megatron_grad_buffer")):
        p = predict_module_memory(model, x, y, optimizer="adam:fused", strategy=dp2,
                                  options=TrainingOptions(framework=framework))
        assert p.inside_allocator[name] == PARAM_BYTES - 4 * frozen.numel()
        assert p.inside_allocator["gradient"] < p.inside_allocator[name] / 2


def test_megatron_buffer_takes_the_place_of_the_traced_gradients():
    """Megatron's backward hook adds each gradient into its buffer and drops ``param.grad``,
    and its optimizer steps the buffer: the traced ``.grad`` tensors (and fp32 master
    gradients) are not held beside it, as torch DDP's are beside its buckets. At this
    optimizer-phase peak (batch 8: every gradient live) they were counted twice; the buffer is
    fp32 at bf16 weights, and Megatron wraps the model at one rank too."""
    x, y = WIDE.example(8)

    def run(framework, precision="fp32", dp=2):
        return predict_module_memory(WIDE.build, x, y, optimizer="adam:fused",
                                     precision=precision, strategy=ParallelStrategy(dp, 1, 1),
                                     options=TrainingOptions(framework=framework))

    ddp, megatron = run("pytorch"), run("megatron")
    assert ddp.inside_allocator["gradient"] == PARAM_BYTES  # every fp32 gradient is live
    assert megatron.inside_allocator["gradient"] == 0
    assert (megatron.inside_allocator["megatron_grad_buffer"]
            == ddp.inside_allocator["ddp_grad_buckets"] == PARAM_BYTES)
    assert (ddp.max_memory_allocated - megatron.max_memory_allocated
            == pytest.approx(PARAM_BYTES, rel=0.02))
    mixed = run("megatron", "bf16-mixed")
    assert mixed.inside_allocator["megatron_grad_buffer"] == PARAM_BYTES
    assert run("pytorch", "bf16-mixed").inside_allocator["ddp_grad_buckets"] == PARAM_BYTES // 2
    one = run("megatron", dp=1)
    assert one.inside_allocator["megatron_grad_buffer"] == PARAM_BYTES
    assert one.max_memory_allocated == megatron.max_memory_allocated  # no ZeRO: dp is moot
    assert "megatron_grad_buffer" not in run("pytorch", dp=1).inside_allocator


def test_cudnn_workspace_is_allocated_around_convolutions():
    cnn = CnnSpec((32, 64), image_res=64, classes=10)
    x, y = cnn.example(16)
    with_ws = predict_module_memory(cnn.build, x, y, device="a100-40gb")
    prof = get_device("a100-40gb")
    off = replace(prof, overheads=replace(prof.overheads, cudnn_workspaces=False))
    no_ws = predict_module_memory(cnn.build, x, y, device=off)
    assert with_ws.max_memory_allocated > no_ws.max_memory_allocated
    assert with_ws.max_memory_reserved >= no_ws.max_memory_reserved
    # on tensor cores (TF32, bf16 autocast) the trace gives convolutions no workspace
    for precision in ("tf32", "bf16"):
        on = predict_module_memory(cnn.build, x, y, device="a100-40gb", precision=precision)
        bare = predict_module_memory(cnn.build, x, y, device=off, precision=precision)
        assert on.max_memory_allocated == bare.max_memory_allocated, precision


def test_cudnn_context_only_for_steps_with_convolutions():
    cnn = CnnSpec((8, 16), image_res=16, classes=10)
    x, y = cnn.example(2)
    conv = predict_module_memory(cnn.build, x, y, device="a100-40gb")
    assert conv.outside_allocator["cudnn"] == CONTEXTS["ampere"].cudnn_bytes == 290 * MiB
    mlp = MlpSpec(32, (64,), 10)
    mx, my = mlp.example(4)
    assert "cudnn" not in predict_module_memory(mlp.build, mx, my,
                                                device="a100-40gb").outside_allocator


def test_gpumemnet_cnn_rows_rebuild_with_their_published_parameters():
    rows = load_cnn_rows()
    assert len(rows) == 833 and {r.arch for r in rows} == {"dense", "residual", "uniform"}
    runnable = [r for r in rows if r.runs]
    assert len(rows) - len(runnable) == 23  # inputs under 7 pixels, or one class
    variants = set()
    for r in runnable[::3]:
        model = build_cnn(r)  # raises unless the count matches the published one
        if r.arch == "dense" and len(model.blocks):
            variants.add((r.depth, len(model.blocks) - r.depth // 4))  # transition blocks
    # both of the generator's transition frequencies occur: some depth with every-5 spacing and
    # the same depth elsewhere with its other spacing, or depths whose count differs from 5's
    assert any(t != max(0, (d // 4 - 2) // 5 + 1) for d, t in variants)
    with pytest.raises(ModelSpecError, match="fails before training"):
        build_cnn(next(r for r in rows if not r.runs))


def test_gpumemnet_generator_rules_rebuild_the_published_networks():
    rows = load_mlp_rows()
    assert len(rows) == 3000
    sample = rows[::15]  # all 3,000 take ~100 s here; the benchmark rebuilds every row it scores
    assert {r.arch for r in sample} == {"pyramid", "uniform", "bottleneck", "gradual"}
    with torch.device("meta"):
        for r in sample:
            build_mlp(r)  # raises when a layer's parameter count differs from the published


def test_gpumemnet_smallest_networks_match_the_measured_device_memory():
    """Deterministic check on shipped real data: a few rows near the context calibration row
    (full evaluation: benchmarks/bench_memory_predictor.py)."""
    rows = load_mlp_rows()
    calib = smallest_network(rows)
    for i in (calib, 2724, 2334):
        r = rows[i]
        x, y = example_batch(r)
        p = predict_module_memory(build_mlp(r), x, y,
                                  loss_fn=default_loss if r.output > 1 else bce_loss)
        assert abs(p.device_used / MiB - r.measured_mib) <= 2, (i, p.device_used / MiB)


def test_the_loaders_smaller_last_batch_fragments_the_cache():
    """GPUMemNet row 2880 (batch 647 of 4096 samples: a last batch of 214) is under-predicted
    by 46 MiB from two full steps; tracing the partial batch between them recovers 14 MiB."""
    r = load_mlp_rows()[2880]
    x, y = example_batch(r)
    two = predict_module_memory(build_mlp(r), x, y)
    three = predict_module_memory(build_mlp(r), x, y, last_batch=4096 % r.batch)
    assert three.max_memory_reserved - two.max_memory_reserved == 14 * MiB
    assert three.device_used / MiB <= r.measured_mib
    with pytest.raises(ModelSpecError):
        predict_module_memory(build_mlp(r), x, y, last_batch=0)


def test_generated_mlp_has_the_generators_layer_order():
    r = load_mlp_rows()[0]  # pyramid, batchnorm, relu, dropout
    kinds = [type(m).__name__ for m in GeneratedMLP(r).model][:4]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Dropout"]


def test_cli_mlp_cnn_and_named_errors(capsys):
    rc = main(["memory", "--model", "mlp", "--input", "512", "--hidden", "256,128",
               "--classes", "10", "--batch", "32", "--precision", "fp32",
               "--device", "a100-40gb", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["verdict"] == "fits" and d["cuda_context"] == CONTEXTS["ampere"].bytes
    assert d["reserved_upper"] <= d["usable"]
    assert (d["margin_lower_coverage"], d["margin_upper_coverage"]) == (0.95, 0.99)
    # a card whose usable part lies between the bounds: tight, exit status 3
    outside = d["device_used"] - d["max_memory_reserved"]
    mid = (d["reserved_lower"] + d["reserved_upper"]) / 2
    rc = main(["memory", "--model", "mlp", "--input", "512", "--hidden", "256,128",
               "--classes", "10", "--batch", "32", "--precision", "fp32",
               "--device", "a100-40gb", "--json", "--capacity-gib",
               str((outside + mid) / 2**30)])
    assert rc == 3 and json.loads(capsys.readouterr().out)["verdict"] == "tight"
    rc = main(["memory", "--model", "cnn", "--channels", "16,32", "--image-res", "32",
               "--batch", "4", "--device", "h200", "--optimizer", "adamw:fused"])
    out = capsys.readouterr().out
    assert rc == 0 and "nvidia-smi" in out and "workspace" in out
    assert main(["memory", "--model", "mlp", "--hidden", "12,x"]) == 1
    assert "hidden" in capsys.readouterr().err
    assert main(["memory", "--model", "mlp", "--optimizer", "lion"]) == 1
    assert "optimizer" in capsys.readouterr().err
    with pytest.raises(ModelSpecError):
        MlpSpec(0, (4,), 2)
    rc = main(["memory", "--model", "mlp", "--hidden", "4096,4096", "--input", "4096",
               "--batch", "4096", "--capacity-gib", "1.6", "--device", "a100-40gb"])
    assert rc == 2 and "verdict: OOM" in capsys.readouterr().out


def test_module_factory_from_cli(capsys):
    rc = main(["memory", "--model", "module", "--module", "memory_factory:make",
               "--input-shape", "3x16x16", "--batch", "4", "--device", "h100-80gb"])
    assert rc == 0 and "FITS" in capsys.readouterr().out



def test_a_spec_through_the_traced_path_is_the_simulators_step():
    """A preset spec goes through the same trace as the simulated ground truth: with fused
    AdamW (what that trace runs) the reserved peaks are equal; foreach Adam adds its temporary."""
    spec = scaled(PRESETS["llama-7b-like"], 0.125, 2, vocab=8192).with_seq(128)
    cfg = Step.data_parallel(2, "bf16")
    sim = simulate_step(spec, cfg)
    fused = predict_spec_memory(spec, cfg.strategy, precision="bf16", device="h100-80gb",
                                optimizer="adamw:fused")
    assert fused.max_memory_reserved == sim.peak_reserved
    assert fused.max_memory_allocated == sim.peak_allocated
    foreach = predict_spec_memory(spec, cfg.strategy, precision="bf16", device="h100-80gb",
                                  optimizer="adamw")
    assert foreach.max_memory_allocated > fused.max_memory_allocated


def test_checkpointing_under_autocast_traces_and_saves_less():
    """The autocast emulation is re-entered for the recompute (it used to fail there)."""
    spec = scaled(PRESETS["llama-7b-like"], 0.125, 2, vocab=8192).with_seq(256)
    none, full = (simulate_step(spec, Step.data_parallel(4, "bf16", recompute=c))
                  for c in ("none", "full"))
    assert full.breakdown["activation"] < 0.7 * none.breakdown["activation"]
    assert full.peak_allocated < none.peak_allocated
