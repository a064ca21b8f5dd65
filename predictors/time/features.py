"""From (model, strategy, precision, device) to the per-rank work and the feature vector.

Transformer stacks are traced one layer at a time: a TP-sharded layer and the embedding/LM-head
shard, each at micro-batch 1 and 2 (every kernel's FLOPs and bytes are affine in the batch, so
those two traces give any micro-batch exactly), cached, then composed into the critical pipeline
stage. Other models (ViT, conv nets) are traced whole. Nothing here is a hand-written FLOP table:
the numbers come from the traced kernels.

``precision_aware=False`` is the paper's ablation: the step is traced at fp32 and every
precision-describing feature is dropped, as a static-graph predictor would see it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from predictors.devices import Device
from predictors.spec import DEFAULT_OPTIONS, ParallelStrategy, TrainingOptions, TransformerSpec
from predictors.spec.options import fp8_kernels, selective_recompute
from predictors.spec.precision import RATE_COLUMNS, Precision, get_precision
from predictors.step import Batch
from predictors.time.analytical import Breakdown, StepWork, class_times, iteration_time
from predictors.time.efficiency import for_precision
from predictors.time.network import Topology
from predictors.time.trace import FP8_TRANSPOSE, OP_CLASSES, Trace, trace_step
from predictors.time.zoo import EmbeddingHead, TransformerLayer, ZooModel, build, make_batch

# features of the traced kernels that only vary with precision (the entry's own encoding,
# Precision.encoding, is added to these by precision_feature_names)
TRACED_PRECISION_FEATURES = (
    "cast_bytes", "cast_count", "tc_flop_frac", "matmul_flops_fp32", "matmul_flops_bf16",
    "matmul_flops_fp16", "matmul_flops_fp8", "vec_bytes_fp32", "vec_bytes_bf16",
    "vec_bytes_fp16",
)  # fmt: skip


def precision_feature_names() -> set[str]:
    """Every feature that describes precision, over all registered entries."""
    from predictors.spec.precision import PRECISIONS

    return set(TRACED_PRECISION_FEATURES).union(*(p.encoding() for p in PRECISIONS.values()))


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def target_of(device: Device) -> str:
    return "cpu" if device.kind == "cpu" else "cuda"


def _split(trace: Trace) -> tuple[Trace, Trace]:
    step = Trace([r for r in trace.records if r.phase != "optimizer"])
    opt = Trace([r for r in trace.records if r.phase == "optimizer"])
    return step, opt


@functools.lru_cache(maxsize=4096)  # a CPU data set has ~600 distinct parts
def _part_trace(part: str, spec: TransformerSpec, tp: int, batch: int, precision: str,
                target: str, sequence_parallel: bool = False) -> tuple[Trace, Trace]:  # fmt: skip
    """(forward+backward, optimizer) trace of one layer shard or the embedding/head shard (a
    sequence-parallel layer takes and returns its rank's ``seq / tp`` tokens)."""
    p = get_precision(precision)
    s, h = spec.seq_length, spec.hidden_size
    if part == "layer":
        local = s // tp if sequence_parallel else s

        def model():
            return TransformerLayer(spec, tp, sequence_parallel=sequence_parallel)

        def batch_fn():
            x = torch.randn(batch, local, h, dtype=p.param_dtype, requires_grad=True)
            return Batch([x], x)

        loss = lambda out, _: out.float().sum()  # noqa: E731 - the layer's output feeds the next
    else:

        def model():
            return EmbeddingHead(spec, tp)

        vocab = spec.vocab_size

        def batch_fn():
            return Batch([torch.randint(0, vocab, (batch, s))],
                         torch.randint(0, vocab // tp, (batch, s)))  # fmt: skip

        from predictors.step import default_loss as loss
    trace = trace_step(model, batch_fn, p, target=target, loss_fn=loss)
    return _split(trace)


def _at_batch(part: str, spec: TransformerSpec, tp: int, micro: int, precision: str,
              target: str, sequence_parallel: bool = False) -> tuple[Trace, Trace]:  # fmt: skip
    # the unfused attention merges (batch, heads) into one GEMM batch: at batch 1 autograd can
    # view where it copies at any larger batch, so its traces are taken at 2 and 3 (affine in
    # the batch either way; batch 1 is then priced with the copies of the larger batches)
    base = 2 if spec.attention == "unfused" else 1
    one = _part_trace(part, spec, tp, base, precision, target, sequence_parallel)
    if micro == base:
        return one
    two = _part_trace(part, spec, tp, base + 1, precision, target, sequence_parallel)
    return one[0].scaled(two[0], micro - base), one[1]


def _canonical(spec: TransformerSpec) -> TransformerSpec:
    # traces do not depend on the layer count: share the cache across depths
    return replace(spec, num_layers=1)


def _full_context(layer: Trace, cp: int) -> Trace:
    """A layer traced on its rank's ``seq / cp`` tokens, with its attention kernels attending
    to the whole sequence as ring attention does: ``cp`` times the work of local-only
    attention (the other ranks' K/V blocks), the GEMMs and elementwise ops unchanged."""
    if cp == 1:
        return layer
    scaled = {}
    for r in layer.records:
        if r.op_class == "attention" and id(r) not in scaled:
            scaled[id(r)] = replace(r, flops=r.flops * cp, bytes=r.bytes * cp)
    return Trace([scaled.get(id(r), r) for r in layer.records])


# the kernels of unfused attention (QK^T, softmax, AV) that Megatron's selective re-runs
CORE_ATTENTION = frozenset({"bmm", "baddbmm", "_softmax"})


def recomputed(forward: Trace, options: TrainingOptions) -> Trace:
    """The kernels of ``forward`` (one recomputed block's forward: a transformer layer, or a
    whole non-transformer model) that activation recomputation re-runs in backward: all of
    them under ``full``; under ``selective`` what the framework's policy does not keep
    (:func:`predictors.spec.options.selective_recompute`)."""
    fwd = [r for r in forward.records if r.phase == "forward"]
    if options.recompute == "none":
        return Trace()
    if options.recompute == "full":
        return Trace(fwd)
    if selective_recompute(options.framework) == "core_attention":
        # fused attention kernels, or unfused attention's batched GEMMs and softmax (a
        # layer's linears are plain mm / addmm)
        return Trace([r for r in fwd if r.op_class == "attention" or r.name in CORE_ATTENTION])
    # op-level: the attention outputs and every odd-numbered matmul's are kept
    out, matmuls = [], 0
    for r in fwd:
        if r.op_class == "matmul":
            matmuls += 1
            if matmuls % 2:
                continue
        elif r.op_class == "attention":
            continue
        out.append(r)
    return Trace(out)


def transformer_work(spec: TransformerSpec, strategy: ParallelStrategy, precision: Precision,
                     device: Device, options: TrainingOptions = DEFAULT_OPTIONS) -> StepWork:  # fmt: skip
    strategy.check(strategy.world_size, spec)
    target = target_of(device)
    cp = strategy.cp
    key = replace(_canonical(spec), seq_length=spec.seq_length // cp)  # a rank's tokens
    sp = options.sequence_parallel and strategy.tp > 1
    if sp and key.seq_length % strategy.tp:
        from predictors.spec import StrategyError

        raise StrategyError(f"sequence_parallel=True: a rank's {key.seq_length} tokens do not "
                            f"split over tp={strategy.tp}")  # fmt: skip
    layer_step, layer_opt = _at_batch("layer", key, strategy.tp, strategy.micro_batch,
                                      precision.name, target, sp)  # fmt: skip
    layer_step = _full_context(layer_step, cp)
    # an fp8 recipe covers the layers' linears only under TE: it keeps the embedding and LM
    # head in the high-precision dtype (te.Linear is not used there; LLM Foundry does the
    # same); the project's eager step runs every linear in fp8 (Fp8Kernels)
    fp8 = fp8_kernels(options.framework)
    head_precision = (precision.recipe.fallback if precision.recipe and not fp8.covers_head
                      else precision.name)  # fmt: skip
    head_step, head_opt = _at_batch("head", key, strategy.tp, strategy.micro_batch,
                                    head_precision, target)  # fmt: skip
    if fp8.fused_transpose:  # the cast kernel writes the transposed copy: no kernel of its own
        layer_step, head_step = (Trace([r for r in t.records if r.name != FP8_TRANSPOSE])
                                 for t in (layer_step, head_step))  # fmt: skip
    # every stage runs each micro-batch in lock-step with its neighbours, so the deepest stage
    # (of an uneven split too) sets the pipeline's pace
    layers = strategy.max_stage_layers(spec.num_layers)
    fwd_bwd = layer_step.repeated(layers) + head_step
    # recomputation wraps the transformer layers (Megatron's and torchtitan's checkpointed
    # blocks, LLM Foundry's): the embedding and LM head are not re-run
    recompute = recomputed(layer_step, options).repeated(layers)
    optimizer = layer_opt.repeated(layers) + head_opt
    act_width = _bits(precision.compute_dtype if precision.autocast else precision.param_dtype) / 8
    act_bytes = strategy.micro_batch * key.seq_length * spec.hidden_size * act_width
    # the TP collectives move whole activations either way (sequence parallelism's
    # all-gather + reduce-scatter are the two halves of the all-reduce it replaces); the
    # pipeline sends a sequence-parallel rank's shard only
    pp_bytes = act_bytes / strategy.tp if sp else act_bytes
    head_dim = spec.hidden_size // spec.num_attention_heads
    kv_block = 2 * strategy.micro_batch * key.seq_length * spec.kv_heads // strategy.tp * head_dim
    cp_sends = 3 * (cp - 1) * layers  # per layer: K,V forward; K,V and dK,dV backward
    # a fully recomputed layer's forward runs its two TP collectives again
    tp_per_layer = 6 if options.recompute == "full" else 4
    params_layer = sum(_numel(s) for s in _opt_param_shapes(layer_opt))
    params_head = sum(_numel(s) for s in _opt_param_shapes(head_opt))
    grad_elems = layers * params_layer + params_head
    return StepWork(
        fwd_bwd=fwd_bwd,
        optimizer=optimizer,
        tp_bytes=tp_per_layer * layers * act_bytes if strategy.tp > 1 else 0.0,
        tp_collectives=tp_per_layer * layers if strategy.tp > 1 else 0,
        dp_grad_bytes=grad_elems * _bits(precision.grad_dtype) / 8,
        dp_grad_elements=grad_elems,
        pp_bytes=pp_bytes,
        fp8_tensors=sum(r.name == "_scaled_mm" for r in fwd_bwd.records),
        fp8_recipe=precision.recipe,
        cp_bytes=cp_sends * kv_block * act_width,
        cp_sends=cp_sends,
        recompute=recompute,
    )


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _opt_param_shapes(opt: Trace) -> list[tuple[int, ...]]:
    for r in opt.records:
        if r.name in ("_fused_adamw_", "_fused_adam_"):
            n = len(r.in_shapes) // 4  # params, grads, exp_avgs, exp_avg_sqs (+ scalars)
            return list(r.in_shapes[:n])
    return []


@functools.lru_cache(maxsize=1024)
def _module_trace(spec: ZooModel, micro: int, precision: str, target: str) -> tuple[Trace, Trace]:
    trace = trace_step(lambda: build(spec), lambda: make_batch(spec, micro), precision,
                       target=target)  # fmt: skip
    return _split(trace)


def module_work(spec: ZooModel, strategy: ParallelStrategy, precision: Precision,
                device: Device, options: TrainingOptions = DEFAULT_OPTIONS) -> StepWork:  # fmt: skip
    """Data parallelism only (any model): the whole model is one rank's work."""
    if strategy.tp != 1 or strategy.pp != 1:
        from predictors.spec import StrategyError

        raise StrategyError(
            f"strategy {strategy.name}: {spec.family} supports data parallelism only"
        )
    fwd_bwd, opt = _module_trace(spec, strategy.micro_batch, precision.name, target_of(device))
    grad_elems = sum(_numel(s) for s in _opt_param_shapes(opt))
    return StepWork(fwd_bwd, opt, dp_grad_bytes=grad_elems * _bits(precision.grad_dtype) / 8,
                    dp_grad_elements=grad_elems,
                    recompute=recomputed(fwd_bwd, options))  # fmt: skip


def step_work(spec: ZooModel, strategy: ParallelStrategy, precision: Precision,
              device: Device, options: TrainingOptions = DEFAULT_OPTIONS) -> StepWork:  # fmt: skip
    if isinstance(spec, TransformerSpec):
        return transformer_work(spec, strategy, precision, device, options)
    return module_work(spec, strategy, precision, device, options)


def features(spec: ZooModel, strategy: ParallelStrategy, precision: str | Precision,
             device: Device, *, precision_aware: bool = True,
             options: TrainingOptions = DEFAULT_OPTIONS,
             topology: Topology | None = None) -> dict[str, float]:  # fmt: skip
    """Feature vector for the learned model; ``analytical_s`` is the roofline estimate."""
    return features_and_breakdown(spec, strategy, precision, device,
                                  precision_aware=precision_aware, options=options,
                                  topology=topology)[0]  # fmt: skip


def features_and_breakdown(spec: ZooModel, strategy: ParallelStrategy,
                           precision: str | Precision, device: Device, *,
                           precision_aware: bool = True,
                           options: TrainingOptions = DEFAULT_OPTIONS,
                           topology: Topology | None = None) -> tuple[dict[str, float], Breakdown]:  # fmt: skip
    """:func:`features` and the roofline's breakdown they were computed from.

    The network features describe where the communication goes (bytes per rank over NVLink and
    over InfiniBand, nodes each group spans, exposed vs raw collective time), so the correction
    learned on single-node rows sees multi-node rows as "more of the same links", not as an
    unknown regime."""
    p = get_precision(precision)
    if not precision_aware:
        p = get_precision("fp32")
    device = for_precision(device, p, options.framework)
    work = step_work(spec, strategy, p, device, options)
    est = iteration_time(work, strategy, device, options, topology)
    m = strategy.num_microbatches
    f: dict[str, float] = {
        "log_analytical": math.log(est.total),
        "analytical_s": est.total,
        "log_compute_mb": math.log(est.compute_mb),
        "comm_frac": (est.tp_comm_mb * m + est.pp_p2p_mb * m + est.dp_comm) / est.total,
        "tp_comm_frac": est.tp_comm_mb * m / est.total,
        "dp_comm_frac": est.dp_comm / est.total,
        "dp_hidden_frac": (est.dp_comm_raw - est.dp_comm) / est.total,
        "pp_comm_frac": est.pp_p2p_mb * m / est.total,
        "log_bytes_nvlink": math.log1p(est.intra_bytes),
        "log_bytes_ib": math.log1p(est.inter_bytes),
        "ib_bytes_frac": est.inter_bytes / (est.intra_bytes + est.inter_bytes + 1.0),
        "nodes": est.nodes, "tp_nodes": est.tp_nodes, "dp_nodes": est.dp_nodes,
        "pp_nodes": est.pp_nodes,
        "virtual_pipeline": options.virtual_pipeline,
        "cp": strategy.cp,
        "cp_comm_frac": est.cp_comm_mb * m / est.total,
        "overlap_grad_reduce": float(options.overlap_grad_reduce),
        "tp_comm_overlap": float(options.tp_comm_overlap),
        "distributed_optimizer": float(options.distributed_optimizer),
        "bubble_frac": est.bubble / est.total,
        "recompute_frac": est.recompute_mb * m / est.total,
        "fsdp_comm_frac": est.fsdp_comm_mb * m / est.total,
        "fsdp": float(options.fsdp),
        "fp8_recipe_frac": est.fp8_recipe_s / est.total,
        "opt_frac": est.optimizer / est.total,
        "dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp,
        "micro_batch": strategy.micro_batch, "num_microbatches": strategy.num_microbatches,
        "log_params": math.log1p(work.dp_grad_elements),
        "kernels_mb": len(work.fwd_bwd.records),
        # small models are dispatch-bound: the share of the fixed per-kernel cost
        "overhead_frac": len(work.fwd_bwd.records) * device.launch_overhead / est.compute_mb,
        "log_intensity": math.log1p(work.fwd_bwd.total("flops"))
        - math.log1p(work.fwd_bwd.total("bytes")),
    }  # fmt: skip
    times = class_times(work.fwd_bwd, device)
    agg = work.fwd_bwd.by("op_class")
    for cls in OP_CLASSES:
        a = agg.get((cls,), {"flops": 0.0, "bytes": 0.0, "count": 0.0})
        f[f"log_flops_{cls}"] = math.log1p(a["flops"])
        f[f"log_bytes_{cls}"] = math.log1p(a["bytes"])
        f[f"time_frac_{cls}"] = times.get(cls, 0.0) / est.compute_mb
    if precision_aware:
        f.update(_precision_features(work.fwd_bwd, p))
    return f, est


def _precision_features(trace: Trace, p: Precision) -> dict[str, float]:
    from predictors.time.analytical import dtype_key

    mm = dict.fromkeys(RATE_COLUMNS, 0.0)
    vec = dict.fromkeys(RATE_COLUMNS, 0.0)
    tc = total = 0.0
    for r in trace.records:
        k = dtype_key(r)
        if r.op_class in ("matmul", "conv", "attention"):
            mm[k] += r.flops
            total += r.flops
            tc += r.flops if r.tensor_core else 0.0
        else:
            vec[k] += r.bytes
    casts = [r for r in trace.records if r.op_class == "cast"]
    return {
        **p.encoding(),
        "cast_bytes": math.log1p(sum(r.bytes for r in casts)),
        "cast_count": float(len(casts)),
        "tc_flop_frac": tc / total if total else 0.0,
        "matmul_flops_fp32": math.log1p(mm["fp32"] + mm["tf32"]),
        "matmul_flops_bf16": math.log1p(mm["bf16"]),
        "matmul_flops_fp16": math.log1p(mm["fp16"]),
        "matmul_flops_fp8": math.log1p(mm["fp8"] + mm["mxfp8"]),
        "vec_bytes_fp32": math.log1p(vec["fp32"]),
        "vec_bytes_bf16": math.log1p(vec["bf16"]),
        "vec_bytes_fp16": math.log1p(vec["fp16"]),
    }
