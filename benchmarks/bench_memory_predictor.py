"""Benchmark: memory predictor against real GPU measurements, and, apart, against its simulator.

1. GPUMemNet's MLP set (real A100-40GB, ``nvidia-smi memory.used`` peaks; development set,
   CC BY 4.0, see ``predictors/datasets/gpumemnet.py``), zero-shot: each network is rebuilt from
   the generator's rules (checked against the published parameter counts) and goes through the
   public API, ``predict_module_memory(model, inputs, target, optimizer="adam",
   device="a100-40gb", last_batch=4096 % batch)``, the code path users run (the generator's
   loader has 4096 samples and keeps the smaller last batch; ``--two-step`` drops it). Nothing
   is fitted to these rows; the CUDA context of that software stack is the one constant the
   shipped ``ampere`` profile takes from the dataset (its smallest network, which is then
   excluded from the figures here). Headline: MAPE of the DYNAMIC part (measured minus the
   context vs predicted ``max_memory_reserved``, rows with >= 256 MiB dynamic), which the
   context constant cannot flatter; device-level MAPE beside it; a fused-Adam ablation
   (what the predictor assumed before) on a subset. These are DEVELOPMENT-SET figures: the
   margin, last-batch tracing and optimizer implementation were shaped on this set.
2. OOM verdict (``predictors/memory/verdict.py``: fits / tight / oom) over a sweep of budgets:
   every 0.5 GiB from the smallest to the largest measured peak (not picked budgets), each row
   judged with its family's split-conformal margin fitted on the other folds (row position
   mod 5; never the scored fold; relative above ``MARGIN_SCALE``, bytes below, each fitted on
   its own runs), measured "fits" when the observed peak is within the budget.
   False "fits" (``fits``, measured OOM) count NETWORKS (a network falsely called fits at any
   budget counts once; the network x budget pairs are printed beside); ``tight_rate`` is the
   share of network x budget pairs called tight. The same pairs are judged by every
   registered rule users use (``register_rule``): the 80% rule of Fujii et al. (a job
   estimated below 80% of the memory is safe; here: above 100% oom, between undecided =
   tight) on the same point estimate gives ``rule80_false_fits`` (networks) and
   ``rule80_tight_rate``; accelerate's ``estimate-memory`` count ("Training using Adam":
   weights, gradients and Adam states of the whole model, no activations, no context;
   computed by accelerate's own functions on the meta-device network) fits when the count
   does. The line before the last gives accelerate's figures and how many real runs
   (GPUMemNet networks over the sweep, LLaVA's published outcomes) ours and each rule call
   wrongly (``wrong_real_runs_*``: a definite ``fits`` or ``oom`` opposite to the run).
3. GPUMemNet's CNN development rows (dense, residual, uniform: real A100-40GB peaks,
   ``predictors/data/gpumemnet_cnn_dev.csv``), rebuilt by ``build_cnn`` and predicted the same
   way at ``precision="tf32"`` (PyTorch's default for convolutions, ``cudnn.allow_tf32``),
   scored per family; nothing is fitted to them except cuDNN's context (read from the smallest
   conv net, row 600, not scored). Device-level MAPE (``mape_dev_convnets``), the dynamic part,
   the verdict sweep of 2. with the ``conv`` margin (an ``OOM_CRASH`` run must not be called
   fits on the 40 GiB card) and the false-"OOM" rate (``oom`` verdicts / measured fits over
   both sweeps). ``--cnn-coverage`` also predicts the CNN development rows outside the sample
   and checks the ``conv`` margin fitted on the sample against them (held out: the share beyond
   each bound, and that sweep's false fits by ours and the rules).
   DEVELOPMENT SET: the workspace and cuDNN-context rules were shaped with these rows in view.
4. The H200 conv nets of the GPU kit (``predictors/data/gpu/h200-2026-12-04*``: ResNet-18/50,
   DenseNet-121, VGG-16, U-Net x 2 batches x fp32/tf32/bf16, ``max_memory_reserved`` of a real
   step) through the same API: DEVELOPMENT figures (the fp32 workspace rule was read off them;
   each network's tensor-core workspaces come from a model fitted on the other networks'
   event streams, ``predictors.memory.workspaces``; ``--write-workspaces`` fits the shipped
   one on all of them).
5. The allocator rules alone: the real event streams of those steps (run 5,
   ``GPUCHECK_MEMORY_EVENTS``) replayed through the simulator from their recorded segments
   (``predictors.memory.cuda_events``): where this matches and 4. does not, the error is in
   the traced request stream, not in the allocator.
6. Agreement with the simulator (NOT accuracy): the multimodal preset predictor against the
   caching-allocator simulator it shares code with (``predictors/data/memory_ground_truth.csv``,
   held out by family and size).

Rows are a deterministic sample (every ``--every``-th; 1 = all 3,000, ~0.5-2 s each on one
core); predictions are cached in ``--cache`` so a long run can be resumed. The default cache
name carries a hash of the code that makes a prediction, so a cache written by older code is
never reused. Last line:
``mape_dev_convnets=C mape_dynamic=D false_fits_sweep=F false_oom_rate=O tight_rate=T
rule80_false_fits=R8 rule80_tight_rate=T8 mape_mlp_dynamic=M mape_h200_convnets=H
llava_outcomes=K/N`` (goals C <= 5, D <= 10, F = 0 networks over both sweeps, O <= 5%, T < T8,
K = N; a ``tight`` LLaVA verdict is not right); LLaVA's published outcomes
(``predictors/data/llava_outcomes.csv``, LoRA rows included: ``LoraSpec`` in the presets;
pretraining rows with the LLM frozen too) go
through ``predict_peak_memory`` as a user describes the job. The agreement with the simulator is
printed above it, apart.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from predictors.datasets.gpumemnet import CnnRow, MlpRow, load_cnn_rows, load_mlp_rows
from predictors.memory.allocator import GiB, MiB
from predictors.memory.gpumemnet import (
    NUM_SAMPLES,
    bce_loss,
    build_cnn,
    build_mlp,
    example_batch,
    example_cnn_batch,
    smallest_network,
)
from predictors.memory.module import DeviceMemoryPrediction, predict_module_memory
from predictors.memory.verdict import (
    MARGINS_NOTE,
    Margin,
    Verdict,
    cross_fitted,
    judge,
    save_margins,
)
from predictors.step import default_loss

BUDGET_STEP_GIB = 0.5
ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["index", "measured_mib", "device_used_mib", "reserved_mib", "allocated_mib",
          "context_mib", "fused_reserved_mib"]


def prediction_code_version() -> str:
    """Version of the code a GPUMemNet prediction runs through (every module the memory API and
    the GPUMemNet rebuild can import), the shipped models it reads and this benchmark's row
    handling."""
    from predictors.codegraph import code_version
    from predictors.memory.verdict import MARGINS_JSON
    from predictors.memory.workspaces import WORKSPACES_JSON

    # the shipped margins too: a prediction near the card replays bounded by its upper bound
    return code_version("predictors.memory.module", "predictors.memory.gpumemnet",
                        extra=[Path(__file__).resolve(), WORKSPACES_JSON, MARGINS_JSON])[:12]


def _predict(row: MlpRow, optimizer: str, last_batch: bool = False):
    x, y = example_batch(row)
    last = (NUM_SAMPLES % row.batch or None) if last_batch else None
    kw = {"optimizer": optimizer, "loss_fn": default_loss if row.output > 1 else bce_loss,
          "device": "a100-40gb"}
    try:
        return predict_module_memory(build_mlp(row), x, y, last_batch=last, **kw)
    except ValueError:
        if last is None:
            raise
        # BatchNorm refuses a last batch of one sample: the generator's run stops there too,
        # so its peak comes from the full batches
        return predict_module_memory(build_mlp(row), x, y, **kw)


def _load_cache(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    with path.open() as f:
        return {int(r["index"]): r for r in csv.DictReader(f)}


def resumable(cache: Path, fields: list[str], todo: list[int], desc: str, minutes: float,
              predict) -> dict[int, dict]:
    """Every cached prediction, after ``predict(i)`` of the indices in ``todo`` not cached yet
    (each row written as it comes, so a killed run resumes); stops after ``minutes``."""
    from tqdm import tqdm

    done = _load_cache(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    new = not cache.exists()
    deadline = time.monotonic() + minutes * 60
    with cache.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        for i in tqdm([i for i in todo if i not in done], desc=desc, unit="net"):
            if time.monotonic() > deadline:
                print(f"stopped after --minutes {minutes}; rerun to resume", file=sys.stderr)
                break
            rec = {"index": i, **predict(i)}
            w.writerow(rec)
            f.flush()
            done[i] = rec
    return done


def run_gpumemnet(every: int, ablation_every: int, cache: Path, minutes: float,
                  last_batch: bool) -> list[dict]:
    rows = load_mlp_rows()

    def predict(i: int) -> dict:
        p = _predict(rows[i], "adam", last_batch)
        fused = _predict(rows[i], "adam:fused", last_batch) if i % ablation_every == 0 else None
        return {"measured_mib": rows[i].measured_mib, "device_used_mib": p.device_used / MiB,
                "reserved_mib": p.max_memory_reserved / MiB,
                "allocated_mib": p.max_memory_allocated / MiB,
                "context_mib": p.outside_allocator["cuda_context"] / MiB,
                "fused_reserved_mib": "" if fused is None else fused.max_memory_reserved / MiB}

    picked = list(range(0, len(rows), every))
    done = resumable(cache, FIELDS, picked, "GPUMemNet MLPs", minutes, predict)
    return [{k: (float(v) if v not in ("", None) else None) for k, v in done[i].items()
             if k in FIELDS} for i in picked if i in done]


def _pct(a: float, b: float) -> float:
    return 100 * abs(a / b - 1)


def budget_sweep(recs: list[dict]) -> list[float]:
    """Budgets (GiB) every 0.5 GiB from the smallest to the largest measured peak."""
    lo = min(r["measured_mib"] for r in recs) * MiB / GiB
    hi = max(r["measured_mib"] for r in recs) * MiB / GiB
    first = BUDGET_STEP_GIB * math.floor(lo / BUDGET_STEP_GIB)
    n = math.ceil((hi - first) / BUDGET_STEP_GIB)
    return [first + BUDGET_STEP_GIB * k for k in range(n + 1)]


def scored_mlps(recs: list[dict]) -> list[dict]:
    calib = smallest_network(load_mlp_rows())  # the stack's context was read from it
    return [r for r in recs if int(r["index"]) != calib]


def report(recs: list[dict]) -> tuple[float, float]:
    rows = load_mlp_rows()
    recs = scored_mlps(recs)
    errs = [_pct(r["device_used_mib"], r["measured_mib"]) for r in recs]
    signed = [r["device_used_mib"] - r["measured_mib"] for r in recs]
    mape = statistics.fmean(errs)
    dyn = [(r["reserved_mib"], r["measured_mib"] - r["context_mib"]) for r in recs]
    big = [(p, m) for p, m in dyn if m >= 256]
    print(f"GPUMemNet MLP (A100-40GB, real nvidia-smi peaks), {len(recs)} of {len(rows)} rows "
          f"(context {recs[0]['context_mib']:.0f} MiB, read from row {smallest_network(rows)}, not scored):")
    q = statistics.quantiles(errs, n=10)
    print(f"  device-level MAPE {mape:.2f}% (median {statistics.median(errs):.2f}%, p90 "
          f"{q[-1]:.2f}%, max {max(errs):.2f}%); signed error MiB: min {min(signed):+.0f}, "
          f"median {statistics.median(signed):+.0f}, max {max(signed):+.0f}")
    mape_dyn = statistics.fmean(_pct(p, m) for p, m in big)
    print(f"  DEVELOPMENT SET dynamic part (measured - context vs predicted "
          f"max_memory_reserved), rows with >= 256 MiB dynamic ({len(big)}): MAPE "
          f"{mape_dyn:.2f}% (all rows: {statistics.fmean(_pct(p, m) for p, m in dyn if m > 0):.2f}%)")
    abl = [r for r in recs if r["fused_reserved_mib"] is not None
           and r["measured_mib"] - r["context_mib"] >= 256]
    if abl:
        def dyn_mape(key: str) -> float:
            return statistics.fmean(_pct(r[key], r["measured_mib"] - r["context_mib"])
                                    for r in abl)
        print(f"  optimizer ablation on {len(abl)} rows (dynamic part): traced foreach Adam "
              f"{dyn_mape('reserved_mib'):.2f}%, fused Adam (the old assumption) "
              f"{dyn_mape('fused_reserved_mib'):.2f}%")
    under = [-s for s in signed if s < 0]
    print(f"  largest under-prediction {max(under, default=0):.0f} MiB")
    return mape_dyn, mape


CNN_CALIBRATION_ROW = 600  # cuDNN's context was read from it (predictors/memory/overheads.py)
CNN_FIELDS = ["index", "arch", "oom", "measured_mib", "device_used_mib", "reserved_mib",
              "context_mib"]
CARD_GIB = 40.0  # GPUMemNet's A100-40GB


def _predict_cnn(row: CnnRow):
    x, y = example_cnn_batch(row)
    # the generator's cnn.py calls torchinfo's summary(model, input_size=(batch, ...)) on the
    # GPU before it trains: one eval-mode no_grad forward at the training batch, whose blocks
    # the measured run keeps cached (nvidia-smi's peak covers the whole process)
    return predict_module_memory(build_cnn(row), x, y, optimizer="adam", precision="tf32",
                                 device="a100-40gb", last_batch=NUM_SAMPLES % row.batch or None,
                                 inference_forward=True)


def run_cnn(every: int, cache: Path, minutes: float, outside_sample: bool = False) -> list[dict]:
    """Predictions of every ``every``-th trainable CNN row (the sample scored here), or with
    ``outside_sample`` of every other one (``--cnn-coverage``)."""
    rows = load_cnn_rows()

    def predict(i: int) -> dict:
        p = _predict_cnn(rows[i])
        outside = p.outside_allocator
        return {"arch": rows[i].arch, "oom": int(rows[i].oom),
                "measured_mib": rows[i].measured_mib, "device_used_mib": p.device_used / MiB,
                "reserved_mib": p.max_memory_reserved / MiB,
                "context_mib": (outside["cuda_context"] + outside.get("cudnn", 0)) / MiB}

    picked = [i for i in range(len(rows)) if (i % every == 0) != outside_sample
              and rows[i].runs and i != CNN_CALIBRATION_ROW]
    done = resumable(cache, CNN_FIELDS, picked, "GPUMemNet CNNs", minutes, predict)
    return [{k: (v if k == "arch" else float(v)) for k, v in done[i].items() if k in CNN_FIELDS}
            for i in picked if i in done]


def report_cnn(recs: list[dict]) -> tuple[float, float]:
    ok = [r for r in recs if not r["oom"]]
    print(f"GPUMemNet CNN development rows (A100-40GB, real nvidia-smi peaks, precision tf32), "
          f"{len(recs)} scored ({len(recs) - len(ok)} OOM_CRASH), row {CNN_CALIBRATION_ROW} "
          "(cuDNN's context) not scored:")
    by_arch: dict[str, list[float]] = {}
    for r in ok:
        by_arch.setdefault(r["arch"], []).append(100 * (r["device_used_mib"] / r["measured_mib"]
                                                       - 1))
    for arch, errs in sorted(by_arch.items()):
        print(f"  {arch:9s} {len(errs):4d} rows: device-level MAPE "
              f"{statistics.fmean(abs(e) for e in errs):.2f}%, signed "
              f"{statistics.fmean(errs):+.2f}%, worst {min(errs):+.1f}% / {max(errs):+.1f}%")
    mape = statistics.fmean(abs(e) for errs in by_arch.values() for e in errs)
    dyn = [(r["reserved_mib"], r["measured_mib"] - r["context_mib"]) for r in ok]
    big = [(p, m) for p, m in dyn if m >= 256]
    mape_dyn = statistics.fmean(_pct(p, m) for p, m in big)
    print(f"  device-level MAPE {mape:.2f}%; dynamic part (measured - context - cuDNN vs "
          f"predicted max_memory_reserved), rows with >= 256 MiB ({len(big)}): {mape_dyn:.2f}%")
    return mape, mape_dyn


FOLDS = 5  # the margins of the verdict sweep are fitted inside each fold, without the scored one
MARGIN_SCALE = 256 * MiB  # the dense/conv margins are absolute (bytes) below this predicted
# reserved peak, relative above it (verdict.Margin.fit_sized): a small job's error is a 20 MiB
# segment or two, not a share of it. It was the floor below which runs calibrated nothing,
# while the relative margin fitted above it was applied to every job, the small ones too.
RULE80 = 0.8  # Fujii et al.: no job estimated below 80% of the GPU's memory ran out of it


def calibration_pair(r: dict) -> tuple[float, float | None]:
    """(predicted, measured) reserved bytes of a row: measured device memory minus what the
    prediction puts outside the allocator; measured None for a crashed run (no peak)."""
    measured = r["measured_mib"] - (r["device_used_mib"] - r["reserved_mib"])
    return r["reserved_mib"] * MiB, None if r.get("oom") else measured * MiB


# The rules users use, judged beside our verdict on the same jobs: each reads one job's record
# (``device_used_mib``: our point estimate; ``accelerate_mib``: accelerate's count) and a card
Rule = Callable[[dict, float], Verdict]
RULES: dict[str, Rule] = {}


def register_rule(name: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        RULES[name] = rule
        return rule
    return register


@register_rule("rule80")
def rule80(r: dict, budget_gib: float) -> Verdict:
    """The 80% rule on our point estimate: safe below 80% of the memory, out of memory above
    all of it, undecided (``tight``) between."""
    cap = budget_gib * GiB / MiB
    if r["device_used_mib"] < RULE80 * cap:
        return Verdict.FITS
    return Verdict.OOM if r["device_used_mib"] > cap else Verdict.TIGHT


@register_rule("accelerate")
def accelerate_rule(r: dict, budget_gib: float) -> Verdict:
    """``accelerate estimate-memory``'s "Training using Adam" figure (weights, gradients and
    Adam states only: no activations, no CUDA context) against the card: it fits when the
    figure does."""
    return Verdict.FITS if r["accelerate_mib"] <= budget_gib * GiB / MiB else Verdict.OOM


def accelerate_mib(model, dtype: str) -> float:
    """What ``accelerate estimate-memory`` prints as "Training using Adam" for ``model`` (its
    parameters in fp32, on the meta device, as accelerate builds it) trained in ``dtype``
    (``float32`` or ``bfloat16``), through accelerate's own functions: the largest of its
    model / gradients / optimizer / step terms (fp32: 4x the fp32 model size, Adam's two
    states plus the step; bf16 mixed precision: 2x). Address:
    https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator
    (``accelerate.commands.estimate.estimate_training_usage``)."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model)
    return max(estimate_training_usage(total, dtype).values()) / MiB


def with_accelerate(recs: list[dict], build) -> list[dict]:
    """``recs`` with accelerate's figure of each row's network (``build(index)`` on the meta
    device; GPUMemNet trains in fp32)."""
    import torch

    for r in recs:
        with torch.device("meta"):
            r["accelerate_mib"] = accelerate_mib(build(int(r["index"])), "float32")
    return recs


@dataclass
class Calls:
    """One way of calling the sweep's jobs (ours or a rule): its verdicts and the networks it
    calls wrongly (``fits`` at a budget the run exceeded, ``oom`` at one it stayed within)."""

    false_fits: set = field(default_factory=set)  # networks
    false_fit_pairs: int = 0
    false_oom_networks: set = field(default_factory=set)
    false_oom: int = 0  # network x budget pairs
    tight: int = 0
    oom: int = 0  # "oom" verdicts, right or wrong

    def record(self, key: str, v: Verdict, measured_oom: bool) -> None:
        self.tight += v is Verdict.TIGHT
        self.oom += v is Verdict.OOM
        if measured_oom and v is Verdict.FITS:
            self.false_fits.add(key)
            self.false_fit_pairs += 1
        if not measured_oom and v is Verdict.OOM:
            self.false_oom_networks.add(key)
            self.false_oom += 1

    def add(self, other: Calls) -> None:
        for k in ("false_fit_pairs", "false_oom", "tight", "oom"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.false_fits |= other.false_fits
        self.false_oom_networks |= other.false_oom_networks

    @property
    def wrong(self) -> set:
        """Networks called wrongly at some budget of the sweep."""
        return self.false_fits | self.false_oom_networks


@dataclass
class Sweep:
    """Verdicts over a budget sweep: ours (calibrated margin) and every registered rule's."""

    pairs: int = 0  # network x budget pairs judged
    measured_fits: int = 0
    networks: set = field(default_factory=set)
    ours: Calls = field(default_factory=Calls)
    rules: dict[str, Calls] = field(default_factory=lambda: {n: Calls() for n in RULES})

    def false_oom_rate(self, calls: Calls) -> float:
        """% of the measured fits that ``calls`` called ``oom``."""
        return 100 * calls.false_oom / max(self.measured_fits, 1)

    def add(self, other: Sweep) -> None:
        self.pairs += other.pairs
        self.measured_fits += other.measured_fits
        self.networks |= other.networks
        self.ours.add(other.ours)
        for name, calls in other.rules.items():
            self.rules[name].add(calls)


def verdict_at(r: dict, margin: Margin, budget_gib: float) -> Verdict:
    """Our verdict for row ``r`` on a card of ``budget_gib``: its predicted reserved bytes, what
    lives outside the allocator (device-level minus reserved) and ``margin``."""
    return judge(int(r["reserved_mib"] * MiB), int((r["device_used_mib"] - r["reserved_mib"])
                 * MiB), int(budget_gib * GiB), margin).verdict


def verdict_sweep(recs: list[dict], family: str, name: str,
                  crash_card_gib: float | None = None, fitted: Margin | None = None) -> Sweep:
    """Each row judged at every budget of the sweep with its family's margin fitted on the
    other folds' rows (row position mod ``FOLDS``), or ``fitted`` on rows apart from ``recs``,
    and by every registered rule; crashed runs (``oom``) must not be called ``fits`` on the card
    they crashed on. Networks are keyed ``name:index``."""
    pairs = [calibration_pair(r) for r in recs]
    margins = ([fitted] * len(recs) if fitted is not None else
               cross_fitted([p for p, _ in pairs], [m for _, m in pairs], [family] * len(recs),
                            [k % FOLDS for k in range(len(recs))], MARGIN_SCALE))
    ok = [(r, m) for r, m in zip(recs, margins, strict=True) if not r.get("oom")]
    out = Sweep()
    out.networks = {f"{name}:{int(r['index'])}" for r in recs}
    how = (f"fitted on {fitted.rows} other rows" if fitted is not None else
           f"fitted in {FOLDS} folds without the scored one")
    print(f"{name}: OOM verdict per budget, {family} margins {how}: lower {min(m.lower for m in margins):+.1%}..{max(m.lower for m in margins):+.1%}, "
          f"upper {min(m.upper for m in margins):+.1%}..{max(m.upper for m in margins):+.1%}; "
          f"below {MARGIN_SCALE // MiB} MiB lower "
          f"{min(m.absolute[0] for m in margins) / MiB:+.0f}..{max(m.absolute[0] for m in margins) / MiB:+.0f} MiB, "
          f"upper {min(m.absolute[1] for m in margins) / MiB:+.0f}..{max(m.absolute[1] for m in margins) / MiB:+.0f} MiB "
          f"(nominal coverage: upper {margins[0].upper_coverage:.0%}, lower "
          f"{margins[0].lower_coverage:.0%})")
    print("  budget  measured fits  fits tight  oom  false fits  false oom | "
          + " | ".join(f"{n}: fits tight oom false fits" for n in RULES))
    for b in budget_sweep([r for r, _ in ok]):
        row = Sweep()
        for r, m in ok:
            key = f"{name}:{int(r['index'])}"
            meas_oom = r["measured_mib"] > b * GiB / MiB
            row.pairs += 1
            row.measured_fits += not meas_oom
            row.ours.record(key, verdict_at(r, m, b), meas_oom)
            for rule_name, rule in RULES.items():
                row.rules[rule_name].record(key, rule(r, b), meas_oom)
        o = row.ours
        print(f"  {b:4.1f} GiB {row.measured_fits:8d} {row.pairs - o.tight - o.oom:10d}"
              f" {o.tight:5d} {o.oom:4d} {o.false_fit_pairs:8d} {o.false_oom:10d} | "
              + " | ".join(f"{' ' * len(n)}  {row.pairs - c.tight - c.oom:4d} {c.tight:5d} "
                           f"{c.oom:4d} {len(c.false_fits):10d}" for n, c in row.rules.items()))
        out.add(row)
    if crash_card_gib is not None:
        crashed = [(r, m) for r, m in zip(recs, margins, strict=True) if r.get("oom")]
        for r, m in crashed:
            key = f"{name}:{int(r['index'])}"
            out.ours.record(key, verdict_at(r, m, crash_card_gib), True)
            for rule_name, rule in RULES.items():
                out.rules[rule_name].record(key, rule(r, crash_card_gib), True)
        keys = {f"{name}:{int(r['index'])}" for r, _ in crashed}
        print(f"  OOM_CRASH runs called 'fits' on the {crash_card_gib:.0f} GiB card: "
              f"{sorted(out.ours.false_fits & keys)} of {len(crashed)}")
    o = out.ours
    print(f"  false 'fits': {len(o.false_fits)} networks ({o.false_fit_pairs} network x "
          f"budget pairs); false 'oom' {o.false_oom} of {out.measured_fits} measured fits; "
          f"tight {o.tight} of {out.pairs}; "
          + "; ".join(f"{n}: {len(c.false_fits)} networks falsely safe, false 'oom' "
                      f"{c.false_oom}, tight {c.tight}" for n, c in out.rules.items()))
    return out


def shipped_margin(family: str, recs: list[dict], what: str) -> Margin:
    """A family's margin as ``--write-margins`` ships it: fitted on every calibration row of
    ``recs`` (DEVELOPMENT rows)."""
    pairs = [(p, m) for p, m in map(calibration_pair, recs) if m is not None]
    return Margin.fit_sized(family, [p for p, _ in pairs], [m for _, m in pairs], MARGIN_SCALE,
                            source=f"split-conformal by size on {len(pairs)} {what} "
                            "(A100-40GB, development): relative above "
                            f"{MARGIN_SCALE // MiB} MiB, bytes below")


def write_margins(mlps: list[dict], cnns: list[dict], path: Path) -> None:
    """The shipped margins: every calibration row of each family (DEVELOPMENT rows)."""
    margins = [shipped_margin("dense", mlps, "GPUMemNet MLPs"),
               shipped_margin("conv", cnns, "GPUMemNet CNN development rows")]
    save_margins(margins, path, MARGINS_NOTE)
    for m in margins:
        print(f"wrote {m.describe()}")


def conv_coverage(sample: list[dict], others: list[dict]) -> None:
    """The ``conv`` margin fitted on the scored sample, as ``--write-margins`` would ship it,
    against the development CNN rows outside the sample (which calibrate nothing here): the
    share of them beyond each bound (nominal at most 1 - that side's coverage) and the
    networks it and the rules call wrongly over their own budget sweep."""
    m = shipped_margin("conv", sample, "GPUMemNet CNN rows of the sample")
    ran = [(p, meas) for p, meas in map(calibration_pair, others) if meas is not None]
    bounds = [(m.bounds(int(p)), meas) for p, meas in ran]
    above = sum(meas > hi for (_, hi), meas in bounds)
    below = sum(meas < lo for (lo, _), meas in bounds)
    print(f"conv margin coverage on the {len(ran)} CNN development rows outside the sample "
          f"(DEVELOPMENT; {m.describe()}): above the upper bound {100 * above / len(ran):.2f}%,"
          f" below the lower {100 * below / len(ran):.2f}% (nominal <= "
          f"{100 * (1 - m.upper_coverage):.0f}% above, {100 * (1 - m.lower_coverage):.0f}% "
          "below)")
    cnn_rows = load_cnn_rows()
    sweep = verdict_sweep(with_accelerate(others, lambda i: build_cnn(cnn_rows[i])), "conv",
                          "cnn-outside", crash_card_gib=CARD_GIB, fitted=m)
    print(f"conv_coverage_rows={len(ran)} above_upper={100 * above / len(ran):.2f} "
          f"below_lower={100 * below / len(ran):.2f} "
          f"false_fits={len(sweep.ours.false_fits)} "
          f"tight_rate={100 * sweep.ours.tight / sweep.pairs:.1f} "
          + " ".join(f"{n}_false_fits={len(c.false_fits)} "
                     f"{n}_tight_rate={100 * c.tight / sweep.pairs:.1f}"
                     for n, c in sweep.rules.items()))


H200_RUN = ROOT / "predictors" / "data" / "gpu" / "h200-2026-12-04-run5"  # the event streams


def _h200_rows() -> dict[tuple[str, str], dict]:
    """The GPU kit's conv-net rows, (model-bBATCH, precision) -> the first run's row."""
    seen: dict[tuple[str, str], dict] = {}
    for path in sorted((ROOT / "predictors" / "data" / "gpu").glob("h200-*/memory.csv")):
        with path.open() as f:
            for r in csv.DictReader(f):
                if r["family"] == "vision" and r["status"] == "ok":
                    seen.setdefault((r["model"], r["precision"]), r)
    return seen


def _predict_h200(model: str, precision: str):
    import torch

    from gpucheck.parts.memory import VISION
    from support import convnets

    name, batch = model.rsplit("-b", 1)
    with torch.device("meta"):
        net = convnets.build(name)
    x, y = convnets.batch(name, int(batch), VISION["gpu"][name][0], "meta")
    return predict_module_memory(net, [x], y, optimizer="adamw:foreach", precision=precision,
                                 device="h200")


@dataclass(frozen=True)
class AlignedStep:
    """A recorded H200 step traced once inside ``workspaces.recording()``: its convolution
    calls aligned with the real stream, and the prediction of that trace, which inserts no
    modelled workspace (the no-workspace baseline, for free)."""

    model: str  # NAME-bBATCH
    precision: str
    samples: list  # workspaces.Sample, one per convolution call
    bare: DeviceMemoryPrediction


def aligned_steps(precisions: Collection[str] | None = None) -> list[AlignedStep]:
    """Every recorded H200 conv-net step (of ``precisions``; None: all), each traced once,
    recorded without modelled workspaces, its calls aligned with the real event stream by
    ``workspaces.samples``."""
    from predictors.memory import workspaces
    from predictors.memory.cuda_events import load_steps
    from predictors.spec.precision import get_precision

    out = []
    for step in load_steps(H200_RUN / "memory_events.jsonl.gz"):
        p = step.point
        if p["family"] != "vision" or (precisions is not None
                                       and p["precision"] not in precisions):
            continue
        model = f"{p['model']}-b{p['batch']}"
        with workspaces.recording() as traced:
            bare = _predict_h200(model, p["precision"])
        precision = get_precision(p["precision"])
        cls = workspaces.workspace_class(precision.compute_dtype, precision.tf32)
        out.append(AlignedStep(model, p["precision"],
                               workspaces.samples(p["model"], cls, traced, step), bare))
    return out


def workspace_samples() -> list:
    """Every convolution call of the recorded H200 steps with the workspace the real stream
    allocated for it (:func:`aligned_steps`)."""
    return [s for a in aligned_steps() for s in a.samples]


def write_workspaces(path: Path) -> None:
    from predictors.memory import workspaces

    samples = workspace_samples()
    nets = sorted({s.network for s in samples})
    model = workspaces.fit(samples, f"median over {len(nets)} networks of their median ratios "
                           f"({len(samples)} convolution calls: tf32, bf16 and true fp32) of the "
                           f"H200 event streams ({', '.join(nets)}; {H200_RUN.name}), DEVELOPMENT")
    model.save(path)
    print(f"wrote {path}: " + ", ".join(f"{'/'.join(k)} {r:.2f}"
                                         for k, r in sorted(model.ratios.items())))


def h200_convnets() -> float | None:
    """The GPU kit's conv-net rows through ``predict_module_memory`` (DEVELOPMENT), each
    network's tensor-core workspaces from a model fitted on the other networks' streams."""
    from predictors.memory import workspaces

    seen = _h200_rows()
    if not seen:
        return None
    samples = workspace_samples()
    errs = []
    try:
        for (model, precision), r in sorted(seen.items()):
            net = model.rsplit("-b", 1)[0]
            workspaces.register_model(workspaces.fit(s for s in samples if s.network != net))
            p = _predict_h200(model, precision)
            errs.append(100 * (p.max_memory_reserved / float(r["peak_reserved"]) - 1))
            print(f"  {model:17s} {precision:5s} reserved {float(r['peak_reserved']) / GiB:6.2f}"
                  f" GiB, predicted {p.max_memory_reserved / GiB:6.2f} ({errs[-1]:+.1f}%)")
    finally:
        workspaces.register_model(None)
    mape = statistics.fmean(abs(e) for e in errs)
    tc = [abs(e) for (_, prec), e in zip(sorted(seen), errs, strict=True) if prec != "fp32"]
    print(f"H200 conv nets (DEVELOPMENT; workspaces, tensor-core and true fp32, fitted "
          f"without the scored network), {len(errs)} configurations: "
          f"max_memory_reserved MAPE {mape:.2f}% (tensor cores, tf32 and bf16: "
          f"{statistics.fmean(tc):.2f}%)")
    return mape


class _RecordedWorkspaces:
    """Stands in for a :class:`workspaces.WorkspaceModel`: each convolution call of a traced
    step gets the workspace the real stream allocated for the same call (its aligned
    samples, in order, over again: the warm-up step's calls are the measured step's)."""

    def __init__(self, taken: list[int]) -> None:
        self._next = itertools.cycle(taken).__next__

    def workspace(self, cls: str, conv) -> int:
        return self._next()

    def has_class(self, cls: str) -> bool:
        return True


def h200_recorded_workspaces() -> float:
    """Diagnostic (``--recorded-workspaces``): the H200 rows traced with each convolution
    call's *recorded* workspace instead of the model's; the reserved MAPE left is what the
    trace and the allocator simulator miss with the workspaces right."""
    from predictors.memory import workspaces

    seen = _h200_rows()
    errs = []
    try:
        for a in aligned_steps():
            workspaces.register_model(_RecordedWorkspaces([s.workspace for s in a.samples]))
            p = _predict_h200(a.model, a.precision)
            errs.append(_pct(p.max_memory_reserved,
                             float(seen[(a.model, a.precision)]["peak_reserved"])))
    finally:
        workspaces.register_model(None)
    mape = statistics.fmean(errs)
    print(f"H200 conv nets with each call's recorded workspace (diagnostic), {len(errs)} "
          f"configurations: max_memory_reserved MAPE {mape:.2f}% (max {max(errs):.2f}%)")
    return mape


def allocator_on_real_streams() -> tuple[float, float] | None:
    """MAPE of the simulator's peaks over the recorded real event streams (allocated,
    reserved)."""
    from predictors.memory.cuda_events import load_steps, replay

    runs = sorted((ROOT / "predictors" / "data" / "gpu").glob("h200-*/memory_events.jsonl.gz"))
    errs_a, errs_r = [], []
    for events in runs:
        with (events.parent / "memory.csv").open() as f:
            real = {(r["model"], r["precision"]): r for r in csv.DictReader(f)}
        for step in load_steps(events):
            p = step.point
            if p["family"] != "vision":
                continue
            r = real[(f"{p['model']}-b{p['batch']}", p["precision"])]
            stats = replay(step)
            errs_a.append(_pct(stats.peak_allocated, float(r["peak_allocated"])))
            errs_r.append(_pct(stats.peak_reserved, float(r["peak_reserved"])))
    if not errs_r:
        return None
    out = statistics.fmean(errs_a), statistics.fmean(errs_r)
    print(f"The allocator simulator on {len(errs_r)} REAL event streams (H200 conv-net steps "
          f"replayed from their recorded segments): peak allocated MAPE {out[0]:.2f}%, peak "
          f"reserved MAPE {out[1]:.2f}% (max {max(errs_r):.2f}%)")
    return out


LLAVA_OUTCOMES = ROOT / "predictors" / "data" / "llava_outcomes.csv"


LLAVA_LORA = 128  # scripts/v1_5/finetune_lora.sh: --lora_r 128 (alpha only scales the update)


def llava_job(r: dict):
    """A ``llava_outcomes.csv`` row as a user describes the job: (model, strategy, options,
    precision, DeepSpeed's buffer sizes). Full finetuning at ``bf16`` as before; a LoRA row
    (``finetune_lora.sh``: rank 128 on every Linear of the LLM, LLaVA's ``find_all_linear_names``,
    the projector trained, the vision tower frozen) at ``bf16-mixed``: LLaVA casts the model to bf16
    before adding the adapters (``llava/train/train.py``, ``bits == 16``) and DeepSpeed keeps fp32
    masters and Adam states of what trains (the adapters and the projector). The ``frozen`` column
    names the frozen towers, ``+``-joined: ``vision`` when finetuning, ``vision+llm`` in pretraining
    (``pretrain.sh``'s ``tune_mm_mlp_adapter``: only the projector trains). ``seq`` is the padded
    LLM sequence, image tokens included (LLaVA pads each batch to its longest sample): the script's
    ``model_max_length`` for finetuning rows, the bound of the caption data for pretraining rows
    (derived in their ``note``). The buffers are LLaVA's ``scripts/zero2.json`` / ``zero3.json``
    (``overlap_comm`` true, ``reduce_bucket_size`` "auto") as the HF Trainer fills them: "auto" is
    the model config's ``hidden_size`` squared (``transformers/integrations/deepspeed.py``,
    ``HfTrainerDeepSpeedConfig.trainer_config_finalize``; LLaVA's config is Llama's, the text
    tower's width). Its ZeRO-3 prefetch bucket ("auto": 0.9 x hidden^2) is priced at DeepSpeed's
    default 5e7 elements, the one the analytical model prices (67 and 50 MiB more than LLaVA's at 7B
    and 13B: above, not below)."""
    from predictors.memory.device import CommBuffers
    from predictors.memory.presets import as_memory_model
    from predictors.spec import LoraSpec, ParallelStrategy, TrainingOptions, foreach_temporaries

    lora = r["lora"] == "1"
    model = as_memory_model(r["model"], seq=int(r["seq"]), image_res=int(r["image_res"]),
                            frozen=tuple(r["frozen"].split("+")),
                            lora=LoraSpec(LLAVA_LORA) if lora else None)
    strategy = ParallelStrategy(int(r["gpus"]), 1, 1, micro_batch=int(r["batch"]))
    # LLaVA trains through DeepSpeed (its scripts' zero2/zero3.json, no "optimizer" section:
    # the HF Trainer's torch AdamW, foreach); the row's torch is what LLaVA's pyproject.toml
    # pinned at the source's date (2.0.1 until 2024-01-31, then 2.1.2)
    options = TrainingOptions.for_zero_stage(
        int(r["zero"]), recompute=r["checkpointing"], framework="deepspeed",
        foreach_temporaries=foreach_temporaries(r["torch"]))
    hidden = model.text.hidden_size
    return (model, strategy, options, "bf16-mixed",
            CommBuffers(reduce_bucket=hidden * hidden, overlap_comm=True))


@dataclass
class Outcome:
    """One published LLaVA outcome and how ours and each registered rule call it."""

    name: str
    outcome: str  # published: fits | oom
    verdict: str  # ours: fits | tight | oom
    rules: dict[str, str]


def llava_outcomes(path: Path = LLAVA_OUTCOMES) -> list[Outcome]:
    """Published LLaVA-1.5 training outcomes (README configurations that trained, issues that
    report OOM; sources in the file) through one call each, as a user describes the job
    (:func:`llava_job`): the preset, batch, sequence, image size, ZeRO stage over the GPUs,
    checkpointing, the frozen vision tower, LoRA and the card; the registered rules on the
    same job (the 80% rule on our point estimate; accelerate's count of the whole model in
    bf16, which knows neither ZeRO nor LoRA, as its users run it). A ``tight`` verdict is not
    right."""
    import torch

    from predictors.memory.api import predict_peak_memory
    from predictors.memory.build import build_model

    out = []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    counted: dict[str, float] = {}
    print(f"LLaVA-1.5 published outcomes ({len(rows)} rows, {LLAVA_OUTCOMES.name}; DEVELOPMENT):")
    for r in rows:
        model, strategy, options, precision, buffers = llava_job(r)
        p = predict_peak_memory(model, strategy, options, precision, r["capacity_gib"],
                                buffers=buffers)
        if r["model"] not in counted:
            with torch.device("meta"):
                counted[r["model"]] = accelerate_mib(build_model(model), "bfloat16")
        job = {"device_used_mib": p.device_used / MiB, "accelerate_mib": counted[r["model"]]}
        cap = p.capacity / GiB
        j = p.judgement
        out.append(Outcome(r["name"], r["outcome"], j.verdict.value,
                           {n: rule(job, cap).value for n, rule in RULES.items()}))
        print(f"  {r['name']:34s} {r['outcome']:4s} predicted {j.verdict.value:5s} (reserved "
              f"{j.lower / GiB:.1f}..{j.upper / GiB:.1f} GiB, usable {j.usable / GiB:.1f} of "
              f"{r['capacity_gib']}) {'ok' if j.verdict.value == r['outcome'] else 'WRONG'}; "
              + ", ".join(f"{n} {v}" for n, v in out[-1].rules.items())
              + f" (accelerate: {counted[r['model']] / 1024:.1f} GiB)")
    return out


def wrong_calls(sweep: Sweep, outcomes: list[Outcome]) -> dict[str, int]:
    """Real runs each way of calling gets wrong: GPUMemNet networks called ``fits`` where they
    ran out of memory or ``oom`` where they fit at some budget of the sweep (or ``fits`` on
    the card they crashed on), and LLaVA outcomes called the opposite of what was published
    (``tight`` is undecided, not wrong)."""
    opposite = {"fits": "oom", "oom": "fits"}
    out = {"ours": len(sweep.ours.wrong)
           + sum(o.verdict == opposite[o.outcome] for o in outcomes)}
    for name, calls in sweep.rules.items():
        out[name] = len(calls.wrong) + sum(o.rules[name] == opposite[o.outcome]
                                           for o in outcomes)
    return out


def simulator_agreement() -> float:
    from predictors.memory.collect import GROUND_TRUTH_CSV
    from predictors.memory.evaluate import evaluate, format_report

    rep = evaluate(GROUND_TRUTH_CSV)
    print("The preset predictor held out by family and size, over both kinds of ground truth "
          "(the table below mixes them):")
    print(format_report(rep))
    gpu = [r for r in rep.rows if r.ground_truth.startswith("cuda")]
    sim = [r for r in rep.rows if r.ground_truth == "sim"]
    if gpu:
        print(f"  the H200 rows alone (real max_memory_reserved, {len(gpu)} held-out "
              f"predictions): MAPE {statistics.fmean(_pct(r.predicted, r.measured) for r in gpu):.2f}%"
              " (DEVELOPMENT: the residual model trains on the other folds' H200 rows)")
    agreement = statistics.fmean(_pct(r.predicted, r.measured) for r in sim)
    print(f"  AGREEMENT WITH THE SIMULATOR (not accuracy), its {len(sim)} rows alone: "
          f"{agreement:.2f}%")
    return agreement


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=20, help="score every N-th row (1 = all)")
    ap.add_argument("--ablation-every", type=int, default=100,
                    help="fused-AdamW ablation on every N-th row")
    ap.add_argument("--cache", type=Path, default=None,
                    help="prediction cache (default out/bench_memory_gpumemnet[_twostep]_"
                         "<code hash>.csv: a cache of older code is not reused)")
    ap.add_argument("--cnn-every", type=int, default=5,
                    help="score every N-th GPUMemNet CNN development row (1 = all 833)")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop predicting after this")
    ap.add_argument("--two-step", action="store_true",
                    help="ablation: trace two full steps only, not the generator's loader "
                         "(4096 samples: a smaller last batch every epoch)")
    ap.add_argument("--write-workspaces", type=Path, default=None,
                    help="fit the tensor-core cuDNN workspace model on every recorded H200 "
                         "stream, write it here (predictors/models/cudnn_workspaces.json) and "
                         "stop")
    ap.add_argument("--cnn-coverage", action="store_true",
                    help="also predict every CNN development row outside the sample (~5 min "
                         "more, cached) and check the conv margin fitted on the sample against "
                         "them (held-out coverage; printed above the last line)")
    ap.add_argument("--recorded-workspaces", action="store_true",
                    help="diagnostic: trace the H200 rows with each convolution call's "
                         "recorded workspace and print their reserved MAPE, then stop")
    ap.add_argument("--write-margins", type=Path, default=None,
                    help="fit the shipped margins on every calibration row, write them here "
                         "(predictors/models/memory_margins.json) and stop")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.write_workspaces:
        write_workspaces(args.write_workspaces)
        return
    if args.recorded_workspaces:
        h200_recorded_workspaces()
        return
    cache = args.cache or ROOT / "out" / (
        f"bench_memory_gpumemnet{'_twostep' if args.two_step else ''}_"
        f"{prediction_code_version()}.csv")
    print(f"prediction cache: {cache}")
    recs = run_gpumemnet(args.every, args.ablation_every, cache, args.minutes,
                         not args.two_step)
    cnn_cache = cache.with_name(f"{cache.stem}_cnn{cache.suffix}")
    cnn = run_cnn(args.cnn_every, cnn_cache, args.minutes)
    if args.write_margins:
        write_margins(scored_mlps(recs), cnn, args.write_margins)
        return
    mape_dyn, mape = report(recs)
    mlp_rows, cnn_rows = load_mlp_rows(), load_cnn_rows()
    sweep = verdict_sweep(with_accelerate(scored_mlps(recs), lambda i: build_mlp(mlp_rows[i])),
                          "dense", "mlp")
    c_mape, c_dyn = report_cnn(cnn)
    sweep.add(verdict_sweep(with_accelerate(cnn, lambda i: build_cnn(cnn_rows[i])), "conv",
                            "cnn", crash_card_gib=CARD_GIB))
    if args.cnn_coverage:
        conv_coverage(cnn, run_cnn(args.cnn_every, cnn_cache, args.minutes,
                                   outside_sample=True))
    h200 = h200_convnets()
    allocator_on_real_streams()
    outcomes = llava_outcomes()
    k, n = sum(o.outcome == o.verdict for o in outcomes), len(outcomes)
    sim = simulator_agreement()
    print(f"agreement with the simulator (not accuracy): {sim:.2f}%")
    print(f"MLP set (development): device-level MAPE {mape:.2f}%")
    print(f"{time.perf_counter() - t0:.0f} s")
    ours, r80, acc = sweep.ours, sweep.rules["rule80"], sweep.rules["accelerate"]
    wrong = wrong_calls(sweep, outcomes)
    runs = len(sweep.networks) + len(outcomes)
    print(f"accelerate_false_fits={len(acc.false_fits)} "
          f"accelerate_false_oom_rate={sweep.false_oom_rate(acc):.1f} "
          f"accelerate_llava_outcomes={sum(o.rules['accelerate'] == o.outcome for o in outcomes)}/{n} "
          + " ".join(f"wrong_real_runs_{name}={w}" for name, w in wrong.items())
          + f" real_runs={runs}")
    print(f"mape_dev_convnets={c_mape:.2f} mape_dynamic={c_dyn:.2f} "
          f"false_fits_sweep={len(ours.false_fits)} "
          f"false_oom_rate={sweep.false_oom_rate(ours):.1f} "
          f"tight_rate={100 * ours.tight / sweep.pairs:.1f} "
          f"rule80_false_fits={len(r80.false_fits)} "
          f"rule80_tight_rate={100 * r80.tight / sweep.pairs:.1f} "
          f"mape_mlp_dynamic={mape_dyn:.2f} "
          f"mape_h200_convnets={'n/a' if h200 is None else f'{h200:.2f}'} llava_outcomes={k}/{n}")


if __name__ == "__main__":
    main()
