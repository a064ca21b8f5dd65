"""Public GPU measurements nobody here produced, used only to score predictions (the
evaluation is :mod:`predictors.time.evaluate`).

* Megatron-LM's H100 weak-scaling table (48-6,144 GPUs, 1-768 nodes): per-GPU model TFLOP/s
  turned into seconds per iteration with Megatron's own FLOP count.

Sources, licences and the settings assumed where a table is silent: ``data/PUBLIC_SOURCES.md``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

from predictors.datasets import data_path
from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec

MEGATRON_CSV = "megatron_h100_weak_scaling.csv"
# --tp-comm-overlap needs --sequence-parallel in Megatron-LM (arguments.py asserts it)
MEGATRON_OPTIONS = TrainingOptions(overlap_grad_reduce=True, tp_comm_overlap=True,
                                   distributed_optimizer=True, overlap_param_gather=True,
                                   sequence_parallel=True)


def megatron_flops(spec: TransformerSpec, batch: int) -> float:
    """``num_floating_point_operations`` of Megatron-LM (training.py, r0.8.0): the FLOPs its
    reported TFLOP/s and MFU are computed from (fwd + bwd, no recomputation)."""
    h, s, L = spec.hidden_size, spec.seq_length, spec.num_layers
    heads, groups = spec.num_attention_heads, spec.kv_heads
    gated = 1.5 if spec.swiglu else 1.0
    attn = 1 + groups / heads + s / h
    return (
        12 * batch * s * L * h * h * (attn + spec.ffn / h * gated + spec.vocab_size / (2 * L * h))
    )


@dataclass(frozen=True)
class PublicRow:
    name: str
    spec: TransformerSpec
    strategy: ParallelStrategy
    precision: str
    device: str
    options: TrainingOptions
    seconds: float  # measured seconds per iteration


def load_megatron_weak_scaling() -> list[PublicRow]:
    rows = []
    with open(data_path(MEGATRON_CSV), newline="") as f:
        for r in csv.DictReader(f):
            spec = TransformerSpec("gpt", int(r["num_layers"]), int(r["hidden_size"]),
                                   int(r["attention_heads"]), 4096, 131072)  # fmt: skip
            gb = int(r["global_batch"])
            strategy = ParallelStrategy(int(r["dp"]), int(r["tp"]), int(r["pp"]), 1, gb)
            if strategy.world_size != int(r["gpus"]):
                raise ValueError(f"{MEGATRON_CSV}: row {r['model']}: dp*tp*pp != gpus")
            seconds = megatron_flops(spec, gb) / (float(r["tflops_per_gpu"]) * 1e12
                                                  * strategy.world_size)  # fmt: skip
            rows.append(PublicRow(f"megatron-{r['model']}", spec, strategy, "bf16-mixed",
                                  "h100-80gb", MEGATRON_OPTIONS, seconds))  # fmt: skip
    return rows
