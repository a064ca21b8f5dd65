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
DDP_BUCKET_ELEMENTS = 40_000_000  # Megatron-Core DDP bucket: max(40M, 1M x dp) elements
# A GPU kernel is launched asynchronously: the host's per-kernel cost (Python, dispatcher,
# launch) overlaps with earlier kernels still running, so a kernel costs the longer of its
# own work (plus the gap between back-to-back kernels) and the host cost. CPU ops are
# synchronous: dispatch adds to the work.
GPU_KERNEL_GAP = 2e-6


def dtype_key(record: OpRecord) -> str:
    if record.dtype_class == "fp8":
        return "fp8"
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
        if device.kind == "gpu" and not record.tensor_core and key != "fp32":
            rate *= 0.5  # misaligned shapes: padded or CUDA-core fallback
        busy = max(flops / rate, record.bytes / device.mem_bw)
    else:
        busy = record.bytes / device.vector_bw(key)
    if device.kind == "gpu":
        return max(busy + GPU_KERNEL_GAP, device.launch_overhead)
    return busy + device.launch_overhead


def trace_time(trace: Trace, device: Device) -> float:
    return sum(op_time(r, device) for r in trace.records)


def class_times(trace: Trace, device: Device) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in trace.records:
        out[r.op_class] = out.get(r.op_class, 0.0) + op_time(r, device)
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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def iteration_time(work: StepWork, strategy: ParallelStrategy, device: Device,
                   options: TrainingOptions = DEFAULT_OPTIONS,
                   topology: Topology | None = None) -> Breakdown:  # fmt: skip
    s = strategy
    topo = topology or topology_of(device)
    groups = megatron_groups(s.dp, s.tp, s.pp, topo)
    compute = trace_time(work.fwd_bwd, device)
    tp = NO_COMM
    if s.tp > 1 and work.tp_collectives:
        each = all_reduce(work.tp_bytes / work.tp_collectives, groups.tp, topo)
        tp = each.times(work.tp_collectives)
    tp_exposed = tp.seconds
    if options.tp_comm_overlap:
        gemm = sum(op_time(r, device) for r in work.fwd_bwd.records if r.op_class == "matmul")
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
    dp_exposed = dp.seconds
    if options.overlap_grad_reduce:
        backward = sum(op_time(r, device) for r in work.fwd_bwd.records if r.phase == "backward")
        dp_exposed = exposed_bucketed([bucket.seconds] * buckets, backward)
    gather = dp if share < 1.0 else NO_COMM
    gather_exposed = gather.seconds
    if options.overlap_param_gather:
        forward = sum(op_time(r, device) for r in work.fwd_bwd.records if r.phase != "backward")
        gather_exposed = exposed_bucketed([bucket.seconds] * buckets, forward)
    dp, dp_exposed = dp + gather, dp_exposed + gather_exposed
    opt = trace_time(work.optimizer, device) / (s.dp if options.distributed_optimizer else 1)
    m = s.num_microbatches
    slot = compute + tp_exposed + p2p.seconds
    bubble = (s.pp - 1) * slot / vp
    total = m * slot + bubble + dp_exposed + opt
    per_iter = tp.times(m) + p2p.times(m) + dp
    return Breakdown(compute, tp_exposed, p2p.seconds, bubble, dp_exposed, opt, total,
                     tp.seconds, dp.seconds, per_iter.intra_bytes, per_iter.inter_bytes,
                     groups.nodes, groups.tp.nodes, groups.dp.nodes, groups.pp.nodes)  # fmt: skip
