"""vTrain ground truth: 1,440 measured Megatron(-DeepSpeed) GPT iteration times on A100s.

Source: the vTrain project (VIA Research Group, KAIST), MIT licence; the CSV and its licence ship
as package data (``predictors/data/ground_truth_single.csv`` and ``LICENSE.vtrain``). Runs are
fp16 mixed precision (fp16 weights, fp32 master weights, dynamic loss scaling) on one node of up
to 8 GPUs over TP/DP/PP, micro- and global-batch size. The GPU variant is not stated in the data;
we plan against ``a100-80gb`` (same compute peaks as the 40 GB part).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from predictors.datasets import data_path
from predictors.spec import ParallelStrategy, TransformerSpec

VTRAIN_CSV = "ground_truth_single.csv"
VTRAIN_LICENSE = "LICENSE.vtrain"
VTRAIN_PRECISION = "fp16-mixed"
VTRAIN_DEVICE = "a100-80gb"
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class VTrainRow:
    spec: TransformerSpec
    strategy: ParallelStrategy
    seconds: float

    @property
    def size(self) -> str:
        """Model-size group used for held-out evaluation: hidden size x depth."""
        return f"h{self.spec.hidden_size}-l{self.spec.num_layers}"


def load_vtrain(path: str | Path | None = None) -> list[VTrainRow]:
    path = Path(path) if path else data_path(VTRAIN_CSV)
    rows = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        for r in csv.DictReader(f):
            spec = TransformerSpec(
                family="gpt",
                num_layers=int(r["# layers"]),
                hidden_size=int(r["hidden size"]),
                num_attention_heads=int(r["attention heads"]),
                seq_length=int(r["sequence length"]),
                vocab_size=GPT2_VOCAB,
                # vTrain's rows come from Megatron-DeepSpeed without --use-flash-attn: its own
                # model of the profiled layer (VIA-Research/vTrain, src/model/gpt_modeling.py)
                # is the classic core attention (baddbmm, fused softmax, dropout, bmm)
                attention="unfused",
            )
            strategy = ParallelStrategy(
                dp=int(r["data parallelism"]),
                tp=int(r["tensor parallelism"]),
                pp=int(r["pipeline parallelism"]),
                micro_batch=int(r["micro batch"]),
                global_batch=int(r["global batch"]),
            )
            if strategy.world_size != int(r["# GPUs"]):
                raise ValueError(f"{path}: row {r} has dp*tp*pp != '# GPUs'")
            rows.append(VTrainRow(spec, strategy, float(r["iteration time (ms)"]) / 1000.0))
    return rows
