"""``predict eval-memory``: held-out accuracy of the memory predictor on collected ground truth.

* held out by family: train on four of LLaVA-like / Qwen-VL-like / BLIP-2-like / LLM / ViT and
  predict the fifth (small and medium sizes);
* held out by size: train on the small and medium models, predict the full-size ones (``xl``);
* OOM verdict for 24/40/80/141 GiB cards (:mod:`verdict`): "fits" when the prediction's
  upper bound (the margin's) + CUDA context <= capacity, where the margin
  is the family of work's split-conformal margin fitted by the fold's model on its own
  training rows' out-of-family residuals (so never on the held-out rows; or a fixed one when
  given), against measured reserved peak + the same CUDA context <= capacity (both sides:
  reserved peak simulated with the same cuBLAS workspaces, the card's context).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from .collect import GROUND_TRUTH_CSV, job_from_row
from .model import MemoryModel, margin_family
from .overheads import CARDS, HOPPER
from .phases import walk_phases
from .verdict import Margin, Verdict, judge


@dataclass
class Row:
    spec: object
    cfg: object
    measured: int  # peak reserved
    family: str
    size: str
    ground_truth: str
    predicted: int = 0
    measured_allocated: int = 0
    margin: Margin | None = None  # the bounds the verdict puts around ``predicted``


@dataclass
class EvalReport:
    ground_truth: str
    mape_by_family: dict[str, float] = field(default_factory=dict)
    mape_by_size: dict[str, float] = field(default_factory=dict)
    mape_heldout: float = 0.0
    mape_analytical: float = 0.0  # analytical peak alone vs the reserved peak
    mape_replay: float = 0.0  # allocator replay alone (no LightGBM residual)
    mape_allocated_analytical: float = 0.0  # analytical peak vs max_memory_allocated
    confusion: dict[str, dict[str, int]] = field(default_factory=dict)
    oom_accuracy: float = 0.0
    margin_fixed: float | None = None  # None: each fold's fitted margins
    margin_range: tuple[float, float] = (0.0, 0.0)  # of the upper bounds used
    margin_coverage: float = 0.0  # % of held-out rows with measured <= predicted x (1 + upper)
    rows: list[Row] = field(default_factory=list)


def skipped_step(row: dict) -> bool:
    """A measurement that is not the job's steady state: fp16 under torch's GradScaler with a
    non-fused AdamW (the row key's optimizer). The kit measures the second step; at
    ``init_scale`` 2**16 the first steps' gradients overflow and ``GradScaler.step`` skips
    ``optimizer.step()`` altogether, so the lazily created Adam states do not exist yet (the
    fused AdamW takes the scale and the found-inf flag into its kernel and creates its states
    either way). The H200 rows show it: each fp16 foreach row is below its fused twin by
    about its Adam states (0.9-1.0 GiB at LLaVA/LLaMA w0.25d4, 0.1-0.2 GiB at ViT-L w0.5d8),
    where the bf16 autocast twins agree; once the scale settles every step holds them."""
    return '"precision": "fp16"' in row["key"] and not row["key"].endswith("|fused")


def load_rows(path: Path = GROUND_TRUTH_CSV) -> list[Row]:
    """The ground-truth rows, less the measurements of a skipped step (:func:`skipped_step`)."""
    with path.open() as f:
        return [Row(*job_from_row(r), int(r["peak_reserved"]),
                    r["family"], r["size"], r["ground_truth"],
                    measured_allocated=int(r["peak_allocated"])) for r in csv.DictReader(f)
                if not skipped_step(r)]


def _mape(rows: list[Row]) -> float:
    return 100 * sum(abs(r.predicted / r.measured - 1) for r in rows) / max(len(rows), 1)


def _fit(rows: list[Row], label: str) -> MemoryModel:
    return MemoryModel.fit([(r.spec, r.cfg, r.measured) for r in rows], trained_on=label)


def fits_card(reserved: int, card: str, margin: Margin | None = None) -> bool:
    """A ``fits`` verdict (:mod:`verdict`) on ``card`` with ``margin`` (none: exact)."""
    capacity, overheads = CARDS[card]
    return judge(reserved, overheads.context_bytes, capacity,
                 margin or Margin.fixed(0.0)).verdict is Verdict.FITS


def _predict(model: MemoryModel, rows: list[Row], margin: float | None) -> None:
    for r in rows:
        r.predicted, _ = model.predict(r.spec, r.cfg)
        fam = margin_family(r.spec)
        r.margin = model.margin(fam) if margin is None else Margin.fixed(margin, fam)


def evaluate(path: Path = GROUND_TRUTH_CSV, margin: float | None = None) -> EvalReport:
    """Held-out evaluation; ``margin`` fixes the verdict's margin at +-``margin`` (default:
    the margins each fold's model fits on its own training rows)."""
    rows = load_rows(path)
    gts = sorted({r.ground_truth for r in rows})
    rep = EvalReport(ground_truth="+".join(gts), margin_fixed=margin)
    small = [r for r in rows if r.size != "xl"]
    held: list[Row] = []
    for fam in sorted({r.family for r in small}):
        test = [r for r in small if r.family == fam]
        _predict(_fit([r for r in small if r.family != fam], f"all but {fam}"), test, margin)
        rep.mape_by_family[fam] = _mape(test)
        held += test
    xl = [r for r in rows if r.size == "xl"]
    if xl:
        _predict(_fit(small, "sizes s+m+l"), xl, margin)
        rep.mape_by_size["xl"] = _mape(xl)
        held += xl
    rep.mape_heldout = _mape(held)
    rep.rows = held
    replay_only = MemoryModel(None, [])
    rep.mape_replay = 100 * sum(abs(replay_only.predict_reserved(r.spec, r.cfg) / r.measured - 1)
                                for r in held) / len(held)
    analytic = {id(r): walk_phases(r.spec, r.cfg, HOPPER).peak_allocated for r in rows}
    rep.mape_analytical = 100 * sum(abs(analytic[id(r)] / r.measured - 1)
                                    for r in held) / len(held)
    rep.mape_allocated_analytical = 100 * sum(abs(analytic[id(r)] / r.measured_allocated - 1)
                                              for r in rows) / len(rows)
    rep.margin_range = (min(r.margin.upper for r in held), max(r.margin.upper for r in held))
    rep.margin_coverage = 100 * sum(r.measured <= r.margin.bounds(r.predicted)[1]
                                    for r in held) / len(held)
    agree = total = 0
    for card in CARDS:
        cm = {"tp": 0, "tn": 0, "fp": 0, "fn": 0}  # positive = predicted OOM
        for r in held:
            pred_oom = not fits_card(r.predicted, card, r.margin)
            meas_oom = not fits_card(r.measured, card)
            cm[("t" if pred_oom == meas_oom else "f") + ("p" if pred_oom else "n")] += 1
            agree += pred_oom == meas_oom
            total += 1
        rep.confusion[f"{card}GiB"] = cm
    rep.oom_accuracy = 100 * agree / max(total, 1)
    return rep


def plot(rep: EvalReport, out: Path = Path("out/memory_pred_vs_measured.png")) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 6))
    for fam in sorted({r.family for r in rep.rows}):
        rs = [r for r in rep.rows if r.family == fam]
        ax.scatter([r.measured / 2**30 for r in rs], [r.predicted / 2**30 for r in rs],
                   label=fam, s=14)
    lim = max(max(r.measured, r.predicted) for r in rep.rows) / 2**30 * 1.1
    ax.plot([1e-3, lim], [1e-3, lim], "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel=f"measured peak reserved, GiB ({rep.ground_truth})",
           ylabel="predicted, GiB", title=f"held-out MAPE {rep.mape_heldout:.2f}%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def format_report(rep: EvalReport) -> str:
    lines = [f"ground truth: {rep.ground_truth} (peak reserved bytes of one steady-state step)"]
    for k, v in rep.mape_by_family.items():
        lines.append(f"  held-out family {k:8s} MAPE {v:6.2f}%")
    for k, v in rep.mape_by_size.items():
        lines.append(f"  held-out size   {k:8s} MAPE {v:6.2f}% (trained on sizes s, m, l)")
    lines.append(f"  analytical peak alone MAPE {rep.mape_analytical:.2f}%; allocator replay "
                 f"alone (no LightGBM residual) MAPE {rep.mape_replay:.2f}%")
    lines.append(f"  analytical peak vs peak *allocated* (all rows) MAPE "
                 f"{rep.mape_allocated_analytical:.2f}%")
    if rep.margin_fixed is None:
        lo, hi = rep.margin_range
        how = f"each fold's split-conformal upper bound per family of work, {lo:.1%}..{hi:.1%}"
    else:
        how = f"fixed {rep.margin_fixed:.1%}"
    how += f"; covers {rep.margin_coverage:.1f}% of held-out rows"
    lines.append(f"OOM verdict (positive = OOM): prediction x (1 + safety margin: {how}) + CUDA "
                 "context vs measured + the same context:")
    for card, cm in rep.confusion.items():
        lines.append(f"  {card:7s} tp={cm['tp']:3d} tn={cm['tn']:3d} fp={cm['fp']:3d} "
                     f"fn={cm['fn']:3d}")
    return "\n".join(lines)
