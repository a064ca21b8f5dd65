"""Roofline time of each traced kernel, composed into an iteration under DP x TP x PP.

Per kernel: ``max(FLOPs / matmul rate in its dtype, bytes / bandwidth) + launch overhead``.
Per iteration (Megatron 1F1B schedule with ``m`` micro-batches on ``pp`` stages, ``vp`` model
chunks per stage): ``(m + (pp - 1)/vp) * (stage compute + exposed TP collectives + PP p2p per
micro-batch)`` (the ``(pp - 1)/vp`` extra slots are the pipeline bubble) ``+ exposed DP gradient
all-reduce (grad dtype, bucketed) + optimizer step``. Every communication cost comes from the
one network model, :mod:`predictors.network` (placement on nodes, NVLink vs InfiniBand, NCCL
ring/tree, overlap).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from predictors.devices import Device
from predictors.network import (
    NO_COMM,
    Topology,
    all_reduce,
    exposed_bucketed,
    megatron_groups,
    topology_of,
)
from predictors.network import p2p as p2p_cost
from predictors.spec import DEFAULT_OPTIONS, ParallelStrategy, TrainingOptions
from predictors.trace import OpRecord, Trace

# Fraction of peak a well-shaped kernel reaches; the learned model corrects the rest.
MATMUL_EFFICIENCY = {"matmul": 0.75, "conv": 0.6, "attention": 0.5}
# fp8 GEMMs reach a smaller share of their (2x) peak than bf16 ones of theirs, and small fp8
# GEMMs can be slower than bf16 (NVIDIA/TransformerEngine#445: a 1024^3 te.Linear in fp8 ran
# 3.6x slower than in bf16; NVIDIA/Megatron-LM#396: a 13B GPT gained 1.35x end to end, "the
# speedup will also vary greatly depending on your model size and micro batch size"). An
# assumption, not fitted to any measured pair: 0.8 x the bf16 share of peak.
RATE_EFFICIENCY = {"fp8": 0.8, "mxfp8": 0.8}
# Transformer Engine's DelayedScaling: once per step one fused kernel updates every fp8
# tensor's amax history and scale (nvte_delayed_scaling_recipe_amax_and_scale_update_after_
# reduction); the amaxes are all-reduced across the data/tensor-parallel group after each
# forward and backward (reduce_amax, TE's default). Current scaling reduces each tensor's amax
# across TP instead (sequence parallel); MXFP8 keeps scales local to 1x32 blocks.
AMAX_BYTES = 4
DDP_BUCKET_ELEMENTS = 40_000_000  # Megatron-Core DDP bucket: max(40M, 1M x dp) elements
# A GPU kernel is launched asynchronously: the host's per-kernel cost (Python, dispatcher,
# launch) overlaps with earlier kernels still running, so a kernel costs the longer of its
# own work (plus the gap between back-to-back kernels) and the host cost. CPU ops are
# synchronous: dispatch adds to the work.
GPU_KERNEL_GAP = 2e-6


def dtype_key(record: OpRecord) -> str:
    if record.dtype_class in ("fp8", "mxfp8"):
        return record.dtype_class
    if record.dtype == "bfloat16":
        return "bf16"
    if record.dtype == "float16":
        return "fp16"
    return "tf32" if record.dtype_class == "tf32" else "fp32"


def op_time(record: OpRecord, device: Device) -> float:
    key = dtype_key(record)
    if record.op_class in MATMUL_EFFICIENCY:
        flops = record.flops * (0.5 if record.causal else 1.0)  # flash kernels skip masked tiles
        rate = device.matmul_rate(key, flops) * MATMUL_EFFICIENCY[record.op_class]
        rate *= RATE_EFFICIENCY.get(key, 1.0)
        if device.kind == "gpu" and not record.tensor_core and key != "fp32":
            rate *= 0.5  # misaligned shapes: padded or CUDA-core fallback
        busy = max(flops / rate, record.bytes / device.mem_bw)
        if device.kind == "gpu":
            busy += device.gemm_latency
    else:
        busy = record.bytes / device.vector_bw(key)
    if device.kind == "gpu":
        return max(busy + GPU_KERNEL_GAP, device.launch_overhead)
    return busy + device.launch_overhead


def record_times(trace: Trace, device: Device) -> list[float]:
    """:func:`op_time` of every record; a layer repeated ``n`` times repeats the same record
    objects, so each distinct record is priced once."""
    seen: dict[int, float] = {}
    out = []
    for r in trace.records:
        t = seen.get(id(r))
        if t is None:
            t = seen[id(r)] = op_time(r, device)
        out.append(t)
    return out


def _sum_where(trace: Trace, device: Device, keep) -> float:
    return sum(t for r, t in zip(trace.records, record_times(trace, device), strict=True)
               if keep(r))  # fmt: skip


def trace_time(trace: Trace, device: Device) -> float:
    return sum(record_times(trace, device))


def class_times(trace: Trace, device: Device) -> dict[str, float]:
    out: dict[str, float] = {}
    for r, t in zip(trace.records, record_times(trace, device), strict=True):
        out[r.op_class] = out.get(r.op_class, 0.0) + t
    return out


@dataclass
class StepWork:
    """What one rank on the critical (last) pipeline stage does in one iteration."""

    fwd_bwd: Trace  # forward + loss + backward of ONE micro-batch
    optimizer: Trace  # the optimizer step (once per iteration)
    tp_bytes: float = 0.0  # bytes all-reduced across TP per micro-batch (all collectives)
    tp_collectives: int = 0  # number of TP all-reduces per micro-batch
    dp_grad_bytes: float = 0.0  # gradient bytes this rank all-reduces across DP
    dp_grad_elements: float = 0.0
    pp_bytes: float = 0.0  # activation bytes sent to the next stage per micro-batch
    fp8_tensors: int = 0  # tensors quantised to fp8 per micro-batch (one per GEMM operand cast)
    fp8_recipe: object | None = None  # predictors.precision.Fp8Recipe of those casts


@dataclass
class Breakdown:
    compute_mb: float  # one micro-batch's forward+backward on the critical stage
    tp_comm_mb: float  # exposed TP collectives per micro-batch
    pp_p2p_mb: float
    bubble: float
    dp_comm: float  # exposed DP gradient all-reduce
    optimizer: float
    total: float
    tp_comm_raw_mb: float = 0.0  # TP collectives per micro-batch before any overlap
    dp_comm_raw: float = 0.0  # DP all-reduce before overlap with backward
    intra_bytes: float = 0.0  # bytes one rank sends over NVLink per iteration
    inter_bytes: float = 0.0  # bytes one rank sends over InfiniBand per iteration
    nodes: int = 1
    tp_nodes: int = 1  # nodes one TP group spans
    dp_nodes: int = 1
    pp_nodes: int = 1
    recompute_mb: float = 0.0  # activation checkpointing: forward re-run per micro-batch
    fsdp_comm_mb: float = 0.0  # exposed FSDP gathers/reduce-scatters per micro-batch
    fp8_recipe_s: float = 0.0  # amax reductions and scale updates per iteration

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def iteration_time(work: StepWork, strategy: ParallelStrategy, device: Device,
                   options: TrainingOptions = DEFAULT_OPTIONS,
                   topology: Topology | None = None) -> Breakdown:  # fmt: skip
    s = strategy
    topo = topology or topology_of(device)
    groups = megatron_groups(s.dp, s.tp, s.pp, topo)
    compute = trace_time(work.fwd_bwd, device)
    recompute = 0.0
    if options.activation_checkpointing:
        recompute = _sum_where(work.fwd_bwd, device, lambda r: r.phase == "forward")
        compute += recompute
    tp = NO_COMM
    if s.tp > 1 and work.tp_collectives:
        each = all_reduce(work.tp_bytes / work.tp_collectives, groups.tp, topo)
        tp = each.times(work.tp_collectives)
    tp_exposed = tp.seconds
    if options.tp_comm_overlap:
        gemm = _sum_where(work.fwd_bwd, device, lambda r: r.op_class == "matmul")
        tp_exposed = max(0.0, tp.seconds - gemm)
    vp = options.virtual_pipeline
    # interleaving: every model chunk boundary is a send; the bubble shrinks by vp
    p2p = p2p_cost(work.pp_bytes, groups.pp.spans_nodes, topo).times(2 * vp) if s.pp > 1 else NO_COMM
    bucket_elements = max(DDP_BUCKET_ELEMENTS, 1_000_000 * s.dp)
    buckets = max(1, math.ceil(work.dp_grad_elements / bucket_elements))
    # the distributed optimizer reduce-scatters gradients and all-gathers the updated
    # parameters (a ring all-reduce is exactly those two halves), and each rank steps 1/dp
    # of the optimizer state
    share = 0.5 if options.distributed_optimizer and s.dp > 1 else 1.0
    bucket = all_reduce(work.dp_grad_bytes / buckets, groups.dp, topo).times(share)
    dp = bucket.times(buckets)
    fsdp_mb, fsdp_exposed = NO_COMM, 0.0
    if options.fsdp and s.dp > 1:
        # per micro-batch: two parameter all-gathers and one gradient reduce-scatter, each half
        # a ring all-reduce; prefetching overlaps them with the micro-batch's compute
        fsdp_mb = all_reduce(work.dp_grad_bytes, groups.dp, topo).times(1.5)
        fsdp_exposed = max(0.0, fsdp_mb.seconds - compute)
        dp = bucket = NO_COMM
    dp_exposed = dp.seconds
    if options.overlap_grad_reduce:
        backward = _sum_where(work.fwd_bwd, device, lambda r: r.phase == "backward")
        dp_exposed = exposed_bucketed([bucket.seconds] * buckets, backward)
    gather = dp if share < 1.0 else NO_COMM
    gather_exposed = gather.seconds
    if options.overlap_param_gather:
        forward = _sum_where(work.fwd_bwd, device, lambda r: r.phase != "backward")
        gather_exposed = exposed_bucketed([bucket.seconds] * buckets, forward)
    dp, dp_exposed = dp + gather, dp_exposed + gather_exposed
    sharded = options.distributed_optimizer or options.fsdp
    opt = trace_time(work.optimizer, device) / (s.dp if sharded else 1)
    m = s.num_microbatches
    fp8_mb, fp8_step = _fp8_recipe_costs(work, groups, topo, device)
    slot = compute + tp_exposed + p2p.seconds + fsdp_exposed + fp8_mb
    bubble = (s.pp - 1) * slot / vp
    total = m * slot + bubble + dp_exposed + opt + fp8_step
    per_iter = tp.times(m) + p2p.times(m) + dp + fsdp_mb.times(m)
    return Breakdown(compute, tp_exposed, p2p.seconds, bubble, dp_exposed, opt, total,
                     tp.seconds, dp.seconds, per_iter.intra_bytes, per_iter.inter_bytes,
                     groups.nodes, groups.tp.nodes, groups.dp.nodes, groups.pp.nodes,
                     recompute, fsdp_exposed, m * fp8_mb + fp8_step)  # fmt: skip


def _fp8_recipe_costs(work: StepWork, groups, topo: Topology, device: Device
                      ) -> tuple[float, float]:  # fmt: skip
    """(per micro-batch, per iteration) seconds of the fp8 recipe's bookkeeping."""
    recipe, n = work.fp8_recipe, work.fp8_tensors
    if recipe is None or not n:
        return 0.0, 0.0
    per_mb = 0.0
    if recipe.per_step_update:  # amax all-reduce after forward and after backward
        group = groups.dp if groups.dp.size >= groups.tp.size else groups.tp
        per_mb = 2 * all_reduce(n * AMAX_BYTES, group, topo).seconds
        history = 2 * n * recipe.amax_history_len * AMAX_BYTES  # read + write, once per step
        step = max(history / device.mem_bw + GPU_KERNEL_GAP, device.launch_overhead)
        return per_mb, step
    if recipe.extra_amax_pass and groups.tp.size > 1:  # one tiny all-reduce per tensor over TP
        per_mb = n * all_reduce(AMAX_BYTES, groups.tp, topo).seconds
    return per_mb, 0.0
