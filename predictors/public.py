"""Public GPU measurements nobody here produced, used only to score predictions.

* Megatron-LM's H100 weak-scaling table (48-6,144 GPUs, 1-768 nodes): per-GPU model TFLOP/s
  turned into seconds per iteration with Megatron's own FLOP count.
* LLM Foundry's H100 bf16 vs fp8 throughput rows (same model, batch and settings; from the
  development fleet file ``llm_foundry_h100.csv``): the measured speed ratio of a pair.

Sources, licences and the settings assumed where a table is silent: ``data/PUBLIC_SOURCES.md``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

import numpy as np

from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec
from predictors.vtrain import data_path

MEGATRON_CSV = "megatron_h100_weak_scaling.csv"
MEGATRON_OPTIONS = TrainingOptions(overlap_grad_reduce=True, tp_comm_overlap=True,
                                   distributed_optimizer=True, overlap_param_gather=True)


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


@dataclass(frozen=True)
class PrecisionPair:
    name: str
    spec: TransformerSpec
    strategy: ParallelStrategy
    device: str
    reference: str  # precision of the slower run
    fast: str
    measured_ratio: float  # t_reference / t_fast
    note: str = ""
    options: TrainingOptions = TrainingOptions()


def load_llm_foundry_pairs() -> list[PrecisionPair]:
    """bf16 vs fp8 on the same MPT run (:func:`predictors.fleet.precision_pairs` over LLM
    Foundry's H100 rows). MPT stores fp32 weights under autocast in both runs; the closest
    pair in our precision table that changes only the matmul dtype is ``bf16-mixed`` vs
    ``fp8`` (both bf16 weights with fp32 masters). The runs use FSDP ``FULL_SHARD`` and, where
    the table says so, full activation recomputation."""
    from predictors.fleet import load_llm_foundry, precision_pairs

    pairs = []
    for ref, fast in precision_pairs(load_llm_foundry()):
        note = "activation checkpointing" if ref.options.recompute != "none" else ""
        pairs.append(PrecisionPair(f"{ref.model}-s{ref.spec.seq_length}", ref.spec, ref.strategy,
                                   ref.device, ref.precision, fast.precision,
                                   ref.seconds / fast.seconds, note, ref.options))  # fmt: skip
    return pairs


@dataclass
class PublicResult:
    name: str
    error: float  # MAPE (%) of times, or mean absolute % error of ratios
    rows: list[tuple[str, float, float]]  # (row, predicted, measured)

    def per_row(self) -> list[tuple[str, float, float, float]]:
        return [(n, p, m, 100.0 * (p - m) / m) for n, p, m in self.rows]


def evaluate_multinode(predict_fn=None) -> PublicResult:
    """Predicted vs measured seconds per iteration on Megatron's H100 weak-scaling runs.
    ``predict_fn(row) -> seconds`` defaults to the shipped predictor."""
    from predictors.time_predictor import predict_iteration_time

    def default(r: PublicRow) -> float:
        return predict_iteration_time(r.spec, r.strategy, r.precision, r.device, options=r.options)

    fn = predict_fn or default
    rows = [(r.name, fn(r), r.seconds) for r in load_megatron_weak_scaling()]
    pred, true = np.array([p for _, p, _ in rows]), np.array([t for _, _, t in rows])
    return PublicResult("megatron_h100_weak_scaling", float(np.mean(np.abs(pred - true) / true) * 100),
                        rows)  # fmt: skip


def evaluate_precision_pairs() -> PublicResult:
    """Error of the predicted speed ratio of each bf16/fp8 pair against the measured one, priced
    by the roofline with its default efficiencies: never fitted on these pairs. (The shipped
    fleet-fitted efficiencies were fitted on these very rows; their held-out pair error is the
    fleet split's, :func:`predictors.evaluate.pair_error`.)"""
    from predictors.time_predictor import predict_with_model

    rows = []
    for p in load_llm_foundry_pairs():
        ref = predict_with_model(None, p.spec, p.strategy, p.reference, p.device, options=p.options)
        fast = predict_with_model(None, p.spec, p.strategy, p.fast, p.device, options=p.options)
        rows.append((p.name, ref / fast, p.measured_ratio))
    pred, true = np.array([p for _, p, _ in rows]), np.array([t for _, _, t in rows])
    return PublicResult("llm_foundry_bf16_fp8_ratio",
                        float(np.mean(np.abs(pred - true) / true) * 100), rows)  # fmt: skip
