"""Roofline time of each traced kernel, composed into an iteration under DP x TP x PP.

Per kernel: ``max(FLOPs / matmul rate in its dtype, bytes / bandwidth) + launch overhead``.
Per iteration (Megatron 1F1B schedule with ``m`` micro-batches on ``pp`` stages):
``(m + pp - 1) * (stage compute + TP all-reduces + PP p2p per micro-batch)`` (the ``pp - 1``
extra slots are the pipeline bubble, a fraction ``(pp-1)/m`` of the useful work) ``+ DP
gradient all-reduce (grad dtype, bucketed) + optimizer step``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from predictors.devices import Device
from predictors.spec import ParallelStrategy
from predictors.trace import OpRecord, Trace

# Fraction of peak a well-shaped kernel reaches; the learned model corrects the rest.
MATMUL_EFFICIENCY = {"matmul": 0.75, "conv": 0.6, "attention": 0.5}
DDP_BUCKET_ELEMENTS = 40_000_000  # Megatron-Core DDP default bucket size


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
    return busy + device.launch_overhead


def trace_time(trace: Trace, device: Device) -> float:
    return sum(op_time(r, device) for r in trace.records)


def class_times(trace: Trace, device: Device) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in trace.records:
        out[r.op_class] = out.get(r.op_class, 0.0) + op_time(r, device)
    return out


def allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce: every rank sends and receives 2(n-1)/n of the buffer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


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
    tp_comm_mb: float
    pp_p2p_mb: float
    bubble: float
    dp_comm: float
    optimizer: float
    total: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def iteration_time(work: StepWork, strategy: ParallelStrategy, device: Device) -> Breakdown:
    s = strategy
    per_node = max(1, device.devices_per_node)
    tp_bw = device.intra_bw if s.tp <= per_node else device.inter_bw
    dp_bw = device.intra_bw if s.tp * s.dp <= per_node else device.inter_bw
    pp_bw = device.intra_bw if s.world_size <= per_node else device.inter_bw
    compute = trace_time(work.fwd_bwd, device)
    tp = 0.0
    if s.tp > 1 and work.tp_collectives:
        each = work.tp_bytes / work.tp_collectives
        tp = work.tp_collectives * allreduce_time(each, s.tp, tp_bw, device.comm_latency)
    p2p = 2 * (work.pp_bytes / pp_bw + device.comm_latency) if s.pp > 1 else 0.0
    buckets = max(1, math.ceil(work.dp_grad_elements / DDP_BUCKET_ELEMENTS))
    dp = sum(
        allreduce_time(work.dp_grad_bytes / buckets, s.dp, dp_bw, device.comm_latency)
        for _ in range(buckets)
    )
    opt = trace_time(work.optimizer, device)
    m = s.num_microbatches
    slot = compute + tp + p2p
    bubble = (s.pp - 1) * slot
    total = m * slot + bubble + dp + opt
    return Breakdown(compute, tp, p2p, bubble, dp, opt, total)
