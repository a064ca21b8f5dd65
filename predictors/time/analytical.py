"""Roofline time of each traced kernel, composed into an iteration under DP x TP x PP x CP.

Per kernel: ``max(FLOPs / (matmul rate in its dtype x efficiency), bytes / bandwidth) + launch
overhead``; the efficiency is the device family's fitted one (``Device.efficiency``,
:mod:`predictors.time.efficiency`) or the default below. Per iteration (Megatron's 1F1B schedule
with ``m`` micro-batches on ``pp`` stages, ``v`` model chunks per stage, interleaved when
``v > 1``): ``m * slot + (pp - 1) * slot / v`` — the bubble is ``(p - 1) / (v m)`` of the ideal
time — where a slot is one micro-batch's compute (plus full or selective recomputation) + the
exposed TP collectives (hidden under the GEMMs with TP overlap) + the PP sends (``2 v`` per
micro-batch: every chunk boundary, forward and backward; with interleaving overlapped with the
chunks' compute, Megatron's default) + the exposed CP ring sends (hidden
under attention) + FSDP gathers not hidden under compute; then ``+`` the exposed DP gradient
reduction over DP x CP (bucketed; reduce-scatter + all-gather with the distributed optimizer,
each overlappable) ``+`` the optimizer step (``1 / (dp cp)`` of it when sharded). Every
communication cost comes from the one network model, :mod:`predictors.time.network` (placement on
nodes, NVLink vs InfiniBand, NCCL ring/tree, overlap).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from predictors.devices import Device
from predictors.spec import DEFAULT_OPTIONS, ParallelStrategy, TrainingOptions
from predictors.time.efficiency import (
    FRAMEWORK_FP8_KEY,
    FRAMEWORK_FUSION_KEY,
    FRAMEWORK_GEMM_KEY,
    FSDP_OVERLAP_KEY,
    TP_OVERLAP_KEY,
)
from predictors.time.network import (
    NO_COMM,
    Topology,
    all_reduce,
    exposed_bucketed,
    megatron_groups,
    topology_of,
)
from predictors.time.network import p2p as p2p_cost
from predictors.time.trace import FP8_TRANSPOSE, OpRecord, Trace

# Fraction of peak a well-shaped kernel reaches: the roofline's fallback where no efficiency
# was fitted for the device family (Device.efficiency, fitted by predictors.time.efficiency on
# development rows; keys "<op_class>:<dtype key>", e.g. "matmul:fp8", "attention:bf16").
MATMUL_EFFICIENCY = {"matmul": 0.75, "conv": 0.6, "attention": 0.5}
# Unfitted fallback for fp8 GEMMs: 0.8 x the bf16 share of their (2x) peak (small fp8 GEMMs
# can be slower than bf16: NVIDIA/TransformerEngine#445; NVIDIA/Megatron-LM#396).
RATE_EFFICIENCY = {"fp8": 0.8, "mxfp8": 0.8}
MATMUL_CLASSES = tuple(MATMUL_EFFICIENCY)
# Device.efficiency key of torch.compile's factor on the non-GEMM kernels' time (fused
# elementwise chains); unfitted: 1 (no fusion assumed)
COMPILED_KEY = "compiled"
# Device.efficiency key of the share of the datasheet bandwidth memory-bound kernels reach (a
# device fact, shared by every framework); unfitted: 1
MEMORY_KEY = "memory"
FP8_KEYS = ("fp8", "mxfp8")
# Device.efficiency key of the share of the bandwidth a standalone transposing copy of an fp8
# tensor reaches (eager ``.t().contiguous()``; fitted per device family where rows run it).
# Unfitted: the bound without cache reuse, one side's 1-byte accesses strided so each uses
# one byte of a 32-byte sector (CUDA C++ Best Practices Guide, "Coalesced Access to Global
# Memory": strided accesses): 2 bytes moved per element cost 1 + 32
TRANSPOSE_KEY = "transpose:fp8"
TRANSPOSE_EFFICIENCY = 2 / 33
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


# SDPA on fp32 operands runs PyTorch's memory-efficient kernel (flash attention takes 16-bit
# operands only), whose fp32 GEMMs on sm80+ are CUTLASS's OpMultiplyAddFastF32: 3xTF32, three
# TF32 tensor-core MMAs per product whatever ``allow_tf32`` says (pytorch/pytorch,
# aten/src/ATen/native/transformers/cuda/mem_eff_attention/gemm_kernel_utils.h,
# DefaultGemmType<ArchTag, float> for kMinComputeCapability >= 80). Priced at a third of the
# tf32 peak, under the one ``attention:tf32`` efficiency of fp32 and tf32 runs alike.
FAST_FP32_MMAS = 3


def attention_rate_key(key: str, device: Device) -> tuple[str, float]:
    """(rate column, MMAs per product) a GPU's attention kernel on ``key`` operands runs at."""
    if key in ("fp32", "tf32") and device.kind == "gpu" and device.peak_flops.get("tf32", 0) > 0:
        return "tf32", FAST_FP32_MMAS
    return key, 1.0


def exposed(comm: float, cover: float, hidden: float = 1.0) -> float:
    """Seconds of ``comm`` seconds of communication left exposed when it overlaps ``cover``
    seconds of compute, of which at most a share ``hidden`` can hide (a fitted overlap share;
    1: all of it, as far as the compute reaches)."""
    return max(comm - cover, (1.0 - hidden) * comm, 0.0)


def dtype_key(record: OpRecord) -> str:
    if record.dtype_class in FP8_KEYS:
        return record.dtype_class
    if record.dtype == "bfloat16":
        return "bf16"
    if record.dtype == "float16":
        return "fp16"
    return "tf32" if record.dtype_class == "tf32" else "fp32"


def efficiency(op_class: str, key: str, device: Device) -> float:
    """Share of the dtype's peak a kernel of ``op_class`` reaches on ``device``: the fitted
    value where the device carries one, else the roofline default."""
    fitted = device.efficiency.get(f"{op_class}:{key}")
    own = default_efficiency(op_class, key) if fitted is None else fitted
    if key in FP8_KEYS:
        own *= device.efficiency.get(FRAMEWORK_FP8_KEY, 1.0)
    return own * device.efficiency.get(FRAMEWORK_GEMM_KEY, 1.0)


def default_efficiency(op_class: str, key: str) -> float:
    return MATMUL_EFFICIENCY[op_class] * RATE_EFFICIENCY.get(key, 1.0)


def op_time(record: OpRecord, device: Device) -> float:
    key = dtype_key(record)
    if record.op_class in MATMUL_EFFICIENCY:
        flops = record.flops * (0.5 if record.causal else 1.0)  # flash kernels skip masked tiles
        mmas = 1.0
        if record.op_class == "attention":
            key, mmas = attention_rate_key(key, device)
        rate = device.matmul_rate(key, flops) * efficiency(record.op_class, key, device) / mmas
        # (the 3xTF32 attention kernel is on tensor cores, its head dim 4-aligned)
        if device.kind == "gpu" and not record.tensor_core and key != "fp32" and mmas == 1.0:
            rate *= 0.5  # misaligned shapes: padded or CUDA-core fallback
        busy = max(flops / rate, record.bytes / device.mem_bw)
        if device.kind == "gpu":
            busy += device.gemm_latency
    else:
        eff = device.efficiency
        bw = device.vector_bw(key) * eff.get(MEMORY_KEY, 1.0)
        if record.name == FP8_TRANSPOSE:
            bw *= eff.get(TRANSPOSE_KEY, TRANSPOSE_EFFICIENCY)
        busy = record.bytes / bw * eff.get(FRAMEWORK_FUSION_KEY, 1.0)
    if device.kind == "gpu":
        return max(busy + GPU_KERNEL_GAP, device.launch_overhead)
    return busy + device.launch_overhead


def priced(trace: Trace, device: Device) -> list[tuple[OpRecord, int, float]]:
    """(record, count, :func:`op_time`) of each distinct record of ``trace``."""
    return [(r, n, op_time(r, device)) for r, n in trace.unique()]


def trace_time(trace: Trace, device: Device) -> float:
    return sum(n * t for _, n, t in priced(trace, device))


def class_times(trace: Trace, device: Device) -> dict[str, float]:
    out: dict[str, float] = {}
    for r, n, t in priced(trace, device):
        out[r.op_class] = out.get(r.op_class, 0.0) + n * t
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
    fp8_recipe: object | None = None  # predictors.spec.precision.Fp8Recipe of those casts
    # context parallelism: K/V bytes one rank sends around the CP ring per micro-batch
    # (forward K,V; backward K,V again and dK,dV), in ``cp_sends`` point-to-point steps
    cp_bytes: float = 0.0
    cp_sends: int = 0
    # activation recomputation: the forward kernels re-run in backward per micro-batch
    recompute: Trace = field(default_factory=Trace)


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
    cp_comm_mb: float = 0.0  # exposed CP ring sends per micro-batch
    cp_nodes: int = 1

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def iteration_time(work: StepWork, strategy: ParallelStrategy, device: Device,
                   options: TrainingOptions = DEFAULT_OPTIONS,
                   topology: Topology | None = None) -> Breakdown:  # fmt: skip
    s = strategy
    topo = topology or topology_of(device)
    groups = megatron_groups(s.dp, s.tp, s.pp, topo, s.cp)
    grad = groups.grad_group  # DP x CP
    fused = device.efficiency.get(COMPILED_KEY, 1.0) if options.compiled else 1.0

    def timed(trace: Trace) -> list[tuple[OpRecord, float]]:
        return [(r, n * (t if r.op_class in MATMUL_CLASSES else t * fused))
                for r, n, t in priced(trace, device)]  # fmt: skip

    kernels = timed(work.fwd_bwd)

    def busy(keep) -> float:
        return sum(t for r, t in kernels if keep(r))

    recompute = sum(t for _, t in timed(work.recompute))
    compute = busy(lambda r: True) + recompute
    tp = NO_COMM
    if s.tp > 1 and work.tp_collectives:
        each = all_reduce(work.tp_bytes / work.tp_collectives, groups.tp, topo)
        tp = each.times(work.tp_collectives)
    tp_exposed = tp.seconds
    if options.tp_comm_overlap:
        tp_exposed = exposed(tp.seconds, busy(lambda r: r.op_class == "matmul"),
                             device.efficiency.get(TP_OVERLAP_KEY, 1.0))
    cp = NO_COMM
    if s.cp > 1 and work.cp_sends:
        # ring attention: each K/V block's send overlaps the attention on the previous block
        cp = p2p_cost(work.cp_bytes / work.cp_sends, groups.cp.spans_nodes, topo).times(
            work.cp_sends)
    cp_exposed = exposed(cp.seconds, busy(lambda r: r.op_class == "attention"))
    vp = options.virtual_pipeline
    # interleaving: every model chunk boundary is a send; the bubble shrinks by vp
    p2p = p2p_cost(work.pp_bytes, groups.pp.spans_nodes, topo).times(2 * vp) if s.pp > 1 else NO_COMM
    p2p_exposed = p2p.seconds
    if vp > 1 and options.overlap_p2p_comm:
        # Megatron's interleaved schedule posts each chunk's sends and receives before the
        # next chunk's compute and waits after it: only what is longer than that is exposed
        p2p_exposed = exposed(p2p.seconds, compute)
    bucket_elements = max(DDP_BUCKET_ELEMENTS, 1_000_000 * s.dp)
    buckets = max(1, math.ceil(work.dp_grad_elements / bucket_elements))
    # the distributed optimizer reduce-scatters gradients and all-gathers the updated
    # parameters (a ring all-reduce is exactly those two halves), and each rank steps 1/dp
    # of the optimizer state
    share = 0.5 if options.distributed_optimizer and grad.size > 1 else 1.0
    bucket = all_reduce(work.dp_grad_bytes / buckets, grad, topo).times(share)
    dp = bucket.times(buckets)
    fsdp_mb, fsdp_exposed = NO_COMM, 0.0
    if options.fsdp and grad.size > 1:
        # per micro-batch: two parameter all-gathers and one gradient reduce-scatter, each half
        # a ring all-reduce; prefetching overlaps them with the micro-batch's compute
        fsdp_mb = all_reduce(work.dp_grad_bytes, grad, topo).times(1.5)
        fsdp_exposed = exposed(fsdp_mb.seconds, compute,
                               device.efficiency.get(FSDP_OVERLAP_KEY, 1.0))
        dp = bucket = NO_COMM
    dp_exposed = dp.seconds
    if options.overlap_grad_reduce:
        dp_exposed = exposed_bucketed([bucket.seconds] * buckets,
                                      busy(lambda r: r.phase == "backward"))  # fmt: skip
    gather = dp if share < 1.0 else NO_COMM
    gather_exposed = gather.seconds
    if options.overlap_param_gather:
        gather_exposed = exposed_bucketed([bucket.seconds] * buckets,
                                          busy(lambda r: r.phase != "backward"))  # fmt: skip
    dp, dp_exposed = dp + gather, dp_exposed + gather_exposed
    sharded = options.distributed_optimizer or options.fsdp
    opt = trace_time(work.optimizer, device) / (grad.size if sharded else 1)
    m = s.num_microbatches
    fp8_mb, fp8_step = _fp8_recipe_costs(work, groups, topo, device)
    slot = compute + tp_exposed + p2p_exposed + fsdp_exposed + fp8_mb + cp_exposed
    bubble = (s.pp - 1) * slot / vp  # bubble / ideal time = (p - 1) / (v * m)
    total = m * slot + bubble + dp_exposed + opt + fp8_step
    per_iter = tp.times(m) + p2p.times(m) + dp + fsdp_mb.times(m) + cp.times(m)
    return Breakdown(compute, tp_exposed, p2p_exposed, bubble, dp_exposed, opt, total,
                     tp.seconds, dp.seconds, per_iter.intra_bytes, per_iter.inter_bytes,
                     groups.nodes, groups.tp.nodes, groups.dp.nodes, groups.pp.nodes,
                     recompute, fsdp_exposed, m * fp8_mb + fp8_step, cp_exposed,
                     groups.cp.nodes)  # fmt: skip


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
