"""Development fleet data: published training throughputs of real GPU fleets, each row turned
into a full run description (model, strategy, precision, device, framework options) and its
measured seconds per iteration.

* ``torchtitan_llama3.csv``: torchtitan's Llama 3.1 8B/70B/405B runs on H100 (FSDP, TP, PP,
  CP; bf16 and float8 pairs; 8-512 GPUs) and its async-TP and H200 benchmark files.
* ``llm_foundry_h100.csv``: LLM Foundry's MPT runs on H100 (bf16 and fp8, 8-512 GPUs).
* ``megatron_narayanan2021_a100.csv``: Narayanan et al. 2021, Table 1 (A100, 32-3,072 GPUs).
* ``megatron_h100_weak_scaling.csv``: the Megatron-LM README's H100 table (48-6,144 GPUs).
* ``time_h200.csv``: this project's own training step timed on one H200 by the GPU kit
  (4 shapes x 10 precisions; framework ``pytorch``), measured here rather than published.
* ``time_<gpu>_megatron.csv``: Megatron-Core steps the GPU kit times through CONA's runtime
  (framework ``megatron``), once a kit run with them is folded.

Each row has a ``use``: ``develop`` rows are fitted on and selected with, inside the folds of
:mod:`predictors.time.evaluate`; ``final`` rows form the split frozen before any tuning and scored
once. Sources, licences and the settings assumed where a table is silent:
``data/PUBLIC_SOURCES.md``. Nothing here fetches anything.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from predictors.datasets import data_path
from predictors.datasets.public import MEGATRON_CSV, PublicRow, load_megatron_weak_scaling
from predictors.devices import get_device
from predictors.spec import ParallelStrategy, TrainingOptions, TransformerSpec
from predictors.spec.precision import get_precision

TORCHTITAN_CSV = "torchtitan_llama3.csv"
FOUNDRY_CSV = "llm_foundry_h100.csv"
NARAYANAN_CSV = "megatron_narayanan2021_a100.csv"
FLEET_FILES = (TORCHTITAN_CSV, FOUNDRY_CSV, NARAYANAN_CSV, MEGATRON_CSV)  # published tables
# measured by this project's GPU kit (provenance: data/README.md and data/gpu/README.md)
H200_STEP_CSV = "time_h200.csv"
# Megatron-Core steps the GPU kit times through CONA's runtime (its megatron part's timed_step
# rows), one file per GPU written by ``python -m gpucheck.fold``: framework megatron
MEGATRON_STEPS_GLOB = "time_*_megatron.csv"
MEGATRON_STEP_COLUMNS = ("model", "spec_json", "strategy", "precision", "seconds", "median_s",
                         "min_s", "iterations", "pred_seconds_before", "gpu", "driver", "cuda",
                         "torch", "date", "git_commit")  # fmt: skip
USES = ("develop", "final")
# the tables' precision labels -> this package's precision table
PRECISION_OF = {
    "bf16": "bf16-mixed",  # torchtitan: FSDP2 bf16 params, fp32 reduce
    "float8": "fp8-current",  # torchao float8 tensorwise: dynamic (current) scaling
    "float8-rowwise": "fp8-rowwise",
    "amp_bf16": "bf16-mixed",  # LLM Foundry: FSDP mixed precision DEFAULT
    "amp_fp8": "fp8",  # LLM Foundry: Transformer Engine DelayedScaling
}
NARAYANAN_SEQ, NARAYANAN_VOCAB = 2048, 51200


class FleetDataError(ValueError):
    """A row of a fleet file that cannot be turned into a run (names the file and field)."""


@dataclass(frozen=True)
class FleetRow(PublicRow):
    """A public measurement with where it comes from and what it may be used for."""

    source: str  # data file
    model: str  # the leave-one-model-out group
    use: str

    @property
    def gpus(self) -> int:
        return self.strategy.world_size

    @property
    def fit_group(self) -> str:
        """The device family and framework its efficiencies are fitted for."""
        from predictors.time.efficiency import fit_group

        return fit_group(get_device(self.device), self.options)

    @property
    def run_key(self) -> tuple:
        """Everything but the precision: two rows with the same key form a precision pair."""
        return (self.source, self.model, self.spec, self.strategy, self.device, self.options)


def _precision(label: str, file: str) -> str:
    try:
        return PRECISION_OF[label]
    except KeyError:
        raise FleetDataError(f"{file}: precision={label!r} is not one of "
                             f"{sorted(PRECISION_OF)}") from None  # fmt: skip


def _use(label: str, file: str) -> str:
    if label not in USES:
        raise FleetDataError(f"{file}: use={label!r} is not one of {USES}")
    return label


def _flag(text: str) -> bool:
    return text.strip() == "True"


def _rows(name: str) -> list[dict[str, str]]:
    with open(data_path(name), newline="") as f:
        return list(csv.DictReader(f))


def load_torchtitan() -> list[FleetRow]:
    """Seconds per iteration from tokens/s/GPU: torchtitan counts each rank's local batch
    (``local_batch * seq`` tokens) over ``cp * tp * pp`` GPUs, so one step takes
    ``global_batch * seq / (tps * gpus)``."""
    out = []
    for r in _rows(TORCHTITAN_CSV):
        spec = TransformerSpec("llama", int(r["num_layers"]), int(r["hidden_size"]),
                               int(r["heads"]), int(r["seq_len"]), int(r["vocab_size"]),
                               ffn_hidden_size=int(r["ffn"]), num_query_groups=int(r["kv_heads"]),
                               swiglu=True, tied_embeddings=False)  # fmt: skip
        dp, local, micro = int(r["dp"]), int(r["local_batch"]), int(r["microbatches"])
        strategy = ParallelStrategy(dp, int(r["tp"]), int(r["pp"]), local // micro, dp * local,
                                    int(r["cp"]))  # fmt: skip
        if strategy.world_size != int(r["gpus"]):
            raise FleetDataError(f"{TORCHTITAN_CSV}: {r['model']}: dp*tp*pp*cp != gpus")
        # torchtitan's TP plan shards the norms' sequence (SequenceParallel) whenever tp > 1
        options = TrainingOptions(fsdp=dp * strategy.cp > 1, tp_comm_overlap=_flag(r["async_tp"]),
                                  sequence_parallel=strategy.tp > 1,
                                  virtual_pipeline=int(r["virtual_pipeline"]),
                                  recompute=r["activation_checkpointing"],
                                  compiled=_flag(r["compile"]), framework="torchtitan")  # fmt: skip
        tokens = strategy.global_batch_size * spec.seq_length
        seconds = tokens / (float(r["tokens_per_s_per_gpu"]) * strategy.world_size)
        tags = ("compile" if options.compiled else "eager") + ("-asynctp" if options.tp_comm_overlap
                                                               else "")  # fmt: skip
        out.append(FleetRow(f"tt{r['table']}-{r['model']}-{strategy.name}-{r['precision']}-{tags}"
                            f"-vp{options.virtual_pipeline}", spec, strategy,
                            _precision(r["precision"], TORCHTITAN_CSV), r["device"], options,
                            seconds, source=TORCHTITAN_CSV, model=r["model"],
                            use=_use(r["use"], TORCHTITAN_CSV)))  # fmt: skip
    return out


def load_llm_foundry() -> list[FleetRow]:
    """MPT runs (learned positions, tied embeddings, flash attention). ``FULL_SHARD`` is FSDP
    ZeRO-3 (:attr:`TrainingOptions.fsdp`); ``SHARD_GRAD_OP`` (ZeRO-2: parameters gathered
    once a step, gradients reduce-scattered) is priced as the distributed optimizer with both
    overlaps."""
    out = []
    for r in _rows(FOUNDRY_CSV):
        spec = TransformerSpec("gpt", int(r["n_layers"]), int(r["d_model"]), int(r["n_heads"]),
                               int(r["seq_len"]), int(r["vocab_size"]))  # fmt: skip
        strategy = ParallelStrategy(int(r["gpus"]), 1, 1, int(r["micro_batch"]),
                                    int(r["global_batch"]))  # fmt: skip
        if strategy.num_microbatches != int(r["grad_accum"]):
            raise FleetDataError(f"{FOUNDRY_CSV}: {r['model']}: grad_accum disagrees with the "
                                 "batch sizes")  # fmt: skip
        recompute = "full" if _flag(r["activation_checkpointing"]) else "none"
        if r["sharding"] == "FULL_SHARD":
            options = TrainingOptions(fsdp=True, recompute=recompute, framework="llm-foundry")
        elif r["sharding"] == "SHARD_GRAD_OP":
            options = TrainingOptions(distributed_optimizer=True, overlap_grad_reduce=True,
                                      overlap_param_gather=True, recompute=recompute,
                                      framework="llm-foundry")  # fmt: skip
        else:
            raise FleetDataError(f"{FOUNDRY_CSV}: sharding={r['sharding']!r} is not FULL_SHARD "
                                 "or SHARD_GRAD_OP")  # fmt: skip
        tokens = strategy.global_batch_size * spec.seq_length
        seconds = tokens / (float(r["tokens_per_s_per_gpu"]) * strategy.world_size)
        out.append(FleetRow(f"foundry-{r['model']}-s{r['seq_len']}-{strategy.name}-"
                            f"{r['precision']}", spec, strategy,
                            _precision(r["precision"], FOUNDRY_CSV), "h100-80gb", options,
                            seconds, source=FOUNDRY_CSV, model=r["model"],
                            use=_use(r["use"], FOUNDRY_CSV)))  # fmt: skip
    return out


def narayanan_flops(spec: TransformerSpec, batch: int) -> float:
    """The FLOPs per iteration Narayanan et al. 2021 (eq. 3) count, activation recomputation
    included: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``."""
    h, s, L, V = spec.hidden_size, spec.seq_length, spec.num_layers, spec.vocab_size
    return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def load_narayanan() -> list[FleetRow]:
    """GPT runs on DGX A100 (mixed precision, full recomputation as the paper's FLOP count
    assumes); micro-batch 1 and the plain 1F1B schedule are assumed (the table is silent)."""
    out = []
    for r in _rows(NARAYANAN_CSV):
        spec = TransformerSpec("gpt", int(r["num_layers"]), int(r["hidden_size"]),
                               int(r["attention_heads"]), NARAYANAN_SEQ,
                               NARAYANAN_VOCAB)  # fmt: skip
        tp, pp, gpus, gb = int(r["tp"]), int(r["pp"]), int(r["gpus"]), int(r["global_batch"])
        strategy = ParallelStrategy(gpus // (tp * pp), tp, pp, 1, gb)
        if strategy.world_size != gpus:
            raise FleetDataError(f"{NARAYANAN_CSV}: {r['params_billion']}B: tp*pp does not "
                                 "divide gpus")  # fmt: skip
        seconds = narayanan_flops(spec, gb) / (float(r["tflops_per_gpu"]) * 1e12 * gpus)
        out.append(FleetRow(f"narayanan-{r['params_billion']}b", spec, strategy, "fp16-mixed",
                            "a100-80gb", TrainingOptions(recompute="full"), seconds,
                            source=NARAYANAN_CSV, model=f"gpt-{r['params_billion']}b",
                            use="develop"))  # fmt: skip
    return out


def load_megatron_h100() -> list[FleetRow]:
    """Megatron-LM's H100 weak-scaling table (:func:`predictors.datasets.public.
    load_megatron_weak_scaling`) as development rows: with Narayanan et al. on A100, the
    public tables Megatron-Core's own efficiencies are fitted on."""
    return [FleetRow(r.name, r.spec, r.strategy, r.precision, r.device, r.options, r.seconds,
                     source=MEGATRON_CSV, model=r.name, use="develop")
            for r in load_megatron_weak_scaling()]  # fmt: skip


def load_h200_steps() -> list[FleetRow]:
    """The GPU kit's H200 times of this project's own step (``predict collect`` columns; each
    point's fastest pass outside contention, :func:`predictors.datasets.measurements.
    load_measurements`) as development rows: one GPU, framework ``pytorch``, the
    leave-one-model-out group the shape. Rows whose run did not report ``status == ok`` are
    left out."""
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import match_gpu_name

    df = load_measurements(data_path(H200_STEP_CSV))
    out = []
    for _, r in df[df["status"] == "ok"].iterrows():
        device = match_gpu_name(str(r["gpu"]), 141 * 2**30)
        if device is None:
            raise FleetDataError(f"{H200_STEP_CSV}: gpu={r['gpu']!r} is not a known GPU")
        if r["spec_kind"] != "TransformerSpec":
            raise FleetDataError(f"{H200_STEP_CSV}: {r['model']}: spec_kind={r['spec_kind']!r} "
                                 "is not a TransformerSpec")
        spec = TransformerSpec(**json.loads(r["spec_json"]))
        dp, micro = int(r["dp"]), int(r["micro_batch"])
        strategy = ParallelStrategy(dp, 1, 1, micro, dp * micro)
        out.append(FleetRow(f"h200step-{r['model']}-{r['precision']}-mb{strategy.micro_batch}",
                            spec, strategy, str(r["precision"]), device.name,
                            TrainingOptions(framework="pytorch"), float(r["seconds"]),
                            source=H200_STEP_CSV, model=str(r["model"]), use="develop"))  # fmt: skip
    return out


def megatron_steps_file(gpu_slug: str) -> str:
    """The file of one GPU's Megatron-Core steps (matches :data:`MEGATRON_STEPS_GLOB`)."""
    return f"time_{gpu_slug}_megatron.csv"


def load_megatron_steps(data_dir: Path | None = None) -> list[FleetRow]:
    """The GPU kit's timed Megatron-Core steps (:data:`MEGATRON_STEP_COLUMNS`, every file of
    :data:`MEGATRON_STEPS_GLOB`) as development rows: framework megatron on the GPU the row
    names, the spec as the runtime built it, the leave-one-model-out group the shape. None
    until a kit run with them has been folded."""
    from predictors.devices import match_gpu_name

    out = []
    for path in sorted((data_dir or data_path(".")).glob(MEGATRON_STEPS_GLOB)):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                device = match_gpu_name(r["gpu"], 0)
                if device is None:
                    raise FleetDataError(f"{path.name}: gpu={r['gpu']!r} is not a known GPU")
                spec = TransformerSpec(**json.loads(r["spec_json"]))
                strategy = ParallelStrategy.parse(r["strategy"])
                out.append(FleetRow(f"mcorestep-{r['model']}-{strategy.name}-{r['precision']}",
                                    spec, strategy, _known_precision(r["precision"], path.name),
                                    device.name, TrainingOptions(framework="megatron"),
                                    float(r["seconds"]), source=path.name,
                                    model=f"mcore-{r['model']}", use="develop"))  # fmt: skip
    return out


def _known_precision(name: str, file: str) -> str:
    from predictors.spec.precision import PRECISIONS

    if name not in PRECISIONS:
        raise FleetDataError(f"{file}: precision={name!r} is not in the precision table")
    return name


def load_fleet(use: str | None = None) -> list[FleetRow]:
    """Every fleet row (``use``: only ``develop`` or only ``final`` rows)."""
    if use is not None:
        _use(use, "load_fleet")
    rows = (load_torchtitan() + load_llm_foundry() + load_narayanan() + load_megatron_h100()
            + load_h200_steps() + load_megatron_steps())
    return [r for r in rows if use is None or r.use == use]


def precision_pairs(rows: list[FleetRow]) -> list[tuple[FleetRow, FleetRow]]:
    """(bf16 row, fp8 row) of the same run: everything but the precision equal (a run measured
    at other precisions too, e.g. the H200 step's fp32 or fp16, pairs only its fp8 rows)."""
    by_key: dict[tuple, dict[str, FleetRow]] = {}
    for r in rows:
        by_key.setdefault(r.run_key, {})[r.precision] = r
    pairs = []
    for runs in by_key.values():
        ref = runs.get("bf16-mixed")
        if ref is None:
            continue
        pairs.extend((ref, fast) for p, fast in sorted(runs.items()) if get_precision(p).fp8)
    return pairs


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
    """bf16 vs fp8 on the same MPT run (:func:`precision_pairs` over LLM
    Foundry's H100 rows). MPT stores fp32 weights under autocast in both runs; the closest
    pair in our precision table that changes only the matmul dtype is ``bf16-mixed`` vs
    ``fp8`` (both bf16 weights with fp32 masters). The runs use FSDP ``FULL_SHARD`` and, where
    the table says so, full activation recomputation."""
    pairs = []
    for ref, fast in precision_pairs(load_llm_foundry()):
        note = "activation checkpointing" if ref.options.recompute != "none" else ""
        pairs.append(PrecisionPair(f"{ref.model}-s{ref.spec.seq_length}", ref.spec, ref.strategy,
                                   ref.device, ref.precision, fast.precision,
                                   ref.seconds / fast.seconds, note, ref.options))  # fmt: skip
    return pairs
