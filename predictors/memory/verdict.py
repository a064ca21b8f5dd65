"""The OOM verdict: ``fits`` / ``tight`` / ``oom`` from a prediction and a calibrated margin.

A point estimate compared with the capacity promises nothing, so the verdict compares an
interval: the predicted reserved bytes times ``1 + margin.upper`` (the upper bound) and times
``1 + margin.lower`` (the lower bound) with the *usable* capacity, what is left of the card
after everything outside the caching allocator (CUDA context, cuDNN's kernels, NCCL) and the
allocator's reserve (a few 20 MiB large-pool segments: a request is served from whole segments,
so the card's last megabytes cannot hold it). ``fits``: the upper bound is below the usable
capacity; ``oom``: even the lower bound exceeds it; ``tight``: in between (launching it is a
gamble the prediction cannot settle).

Margins are split-conformal bounds of the relative residual ``measured / predicted - 1`` of
one family of work (``dense`` and ``conv`` for the traced module path, ``multimodal``,
``text`` and ``vision`` for the presets: their errors differ, conv nets' by cuDNN's transient
workspaces), each with its nominal coverage and the number of rows it was fitted on. Families
are registered (:func:`register_margin`); the shipped ones live in
``predictors/models/memory_margins.json`` (``dense``/``conv`` written by the memory benchmark's
``--write-margins``, ``multimodal``/``text``/``vision`` by the preset model's training). An evaluation fits them inside each fold without the
scored rows (:func:`cross_fitted`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from .allocator import GiB, MiB

ALLOCATOR_RESERVE = 64 * MiB  # a few 20 MiB large-pool segments of slack below the capacity
DEFAULT_COVERAGE = 0.99  # nominal P(measured <= upper bound) and P(measured >= lower bound)
MARGINS_JSON = Path(__file__).resolve().parents[1] / "models" / "memory_margins.json"
MARGINS_NOTE = ("dense/conv: benchmarks/bench_memory_predictor.py --write-margins; "
                "multimodal/text/vision: python -m predictors.memory.train; residual = "
                "measured reserved / predicted - 1")


class Verdict(StrEnum):
    FITS = "fits"
    TIGHT = "tight"
    OOM = "oom"


class MarginError(ValueError):
    pass


def conformal_quantile(errors: Sequence[float], level: float) -> float:
    """Split-conformal upper bound: the ``ceil((n + 1) * level)``-th smallest error, which a
    new exchangeable error exceeds with probability at most ``1 - level`` (the largest error
    when ``n`` is too small for that rank)."""
    if not errors:
        raise MarginError("conformal_quantile needs at least one error")
    e = sorted(errors)
    k = math.ceil((len(e) + 1) * level)
    return float(e[min(k, len(e)) - 1])


@dataclass(frozen=True)
class Margin:
    """Relative bounds around a predicted reserved peak: the measured peak lies in
    ``[predicted x (1 + lower), predicted x (1 + upper)]`` with probability ``coverage`` on
    each side (nominal; ``rows`` residuals calibrated it, 0 where the calibration did not record
    its count)."""

    family: str
    lower: float  # <= 0
    upper: float  # >= 0
    coverage: float | None  # None: a fixed margin, no coverage is claimed
    rows: int
    source: str

    def __post_init__(self) -> None:
        if not -1.0 < self.lower <= 0.0 <= self.upper:
            raise MarginError(f"margin {self.family}: need -1 < lower <= 0 <= upper, got "
                              f"lower={self.lower} upper={self.upper}")

    @classmethod
    def fixed(cls, relative: float, family: str = "fixed") -> Margin:
        """A user's fixed margin ``+-relative`` (no coverage claimed)."""
        if not 0.0 <= relative < 1.0:
            raise MarginError(f"margin={relative} must be in [0, 1)")
        return cls(family, -relative, relative, None, 0, f"fixed +-{relative:.1%}")

    @classmethod
    def fit(cls, family: str, residuals: Sequence[float], coverage: float = DEFAULT_COVERAGE,
            source: str = "") -> Margin:
        """Split-conformal bounds of ``residuals`` (``measured / predicted - 1``): the upper
        bound at ``coverage``, the lower one at ``coverage`` of the negated residuals."""
        if not 0.5 < coverage < 1.0:
            raise MarginError(f"coverage={coverage} must be in (0.5, 1)")
        upper = max(conformal_quantile(residuals, coverage), 0.0)
        lower = min(-conformal_quantile([-r for r in residuals], coverage), 0.0)
        return cls(family, max(lower, -0.99), upper, coverage, len(residuals),
                   source or f"split-conformal, {len(residuals)} residuals")

    def describe(self) -> str:
        cov = ("no coverage claimed" if self.coverage is None
               else f"coverage {self.coverage:.0%} per side"
               + (f" on {self.rows} rows" if self.rows else ""))
        return f"{self.family} margin {self.lower:+.1%} / {self.upper:+.1%} ({cov}; {self.source})"


_MARGINS: dict[str, Margin] = {}


def register_margin(margin: Margin) -> None:
    """Register (or replace) the margin of a family of work."""
    _MARGINS[margin.family] = margin


def margin_for(family: str) -> Margin:
    if not _MARGINS:
        load_margins()
    try:
        return _MARGINS[family]
    except KeyError:
        raise MarginError(f"family={family!r} has no registered margin (known: "
                          f"{', '.join(sorted(_MARGINS))})") from None


def load_margins(path: Path = MARGINS_JSON) -> None:
    """Register the margins stored in ``path`` (the shipped ones by default)."""
    for family, m in json.loads(path.read_text())["margins"].items():
        register_margin(Margin(family, m["lower"], m["upper"], m["coverage"], m["rows"],
                               m["source"]))


def save_margins(margins: Sequence[Margin], path: Path, note: str) -> None:
    """Write ``margins`` into ``path``, keeping the other families stored there (each family's
    ``source`` says what fitted it; ``note`` says what wrote the file last)."""
    stored = json.loads(path.read_text())["margins"] if path.exists() else {}
    stored.update({m.family: {k: v for k, v in asdict(m).items() if k != "family"}
                   for m in margins})
    path.write_text(json.dumps({"note": note, "margins": stored}, indent=1) + "\n")


@dataclass(frozen=True)
class Judgement:
    """A verdict with the numbers that made it (bytes)."""

    verdict: Verdict
    predicted: int  # predicted max_memory_reserved
    lower: int  # its lower bound
    upper: int  # its upper bound
    usable: int  # capacity - outside the allocator - the allocator's reserve
    capacity: int
    margin: Margin

    def as_dict(self) -> dict[str, object]:
        return {"verdict": self.verdict.value, "reserved_lower": self.lower,
                "reserved_upper": self.upper, "usable": self.usable,
                "margin_family": self.margin.family, "margin_lower": self.margin.lower,
                "margin_upper": self.margin.upper, "margin_coverage": self.margin.coverage,
                "margin_rows": self.margin.rows, "margin_source": self.margin.source}

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"verdict: {self.verdict.value.upper()} (reserved {g(self.lower)} .. "
                f"{g(self.upper)} vs usable {g(self.usable)} of {g(self.capacity)}; "
                f"{self.margin.describe()})")


def judge(predicted_reserved: int, outside_allocator: int, capacity: int, margin: Margin,
          out_of_memory: bool = False) -> Judgement:
    """The verdict for a predicted reserved peak. ``out_of_memory``: the replay bounded by the
    usable capacity over the upper margin failed even after freeing its cache, so ``fits``
    cannot be promised (``oom`` still needs the lower bound above the usable capacity)."""
    usable = capacity - outside_allocator - ALLOCATOR_RESERVE
    lower = int(predicted_reserved * (1 + margin.lower))
    upper = int(predicted_reserved * (1 + margin.upper))
    if upper <= usable and not out_of_memory:
        v = Verdict.FITS
    elif lower > usable:
        v = Verdict.OOM
    else:
        v = Verdict.TIGHT
    return Judgement(v, predicted_reserved, lower, upper, usable, capacity, margin)


def cross_fitted(residuals: Sequence[float | None], families: Sequence[str],
                 folds: Sequence[int], coverage: float = DEFAULT_COVERAGE) -> list[Margin]:
    """Per row, the margin of its family fitted on the other folds' rows of that family only
    (the scored fold never calibrates its own margin). A row whose residual is ``None`` is
    judged but calibrates nothing (for example a crashed run with no peak)."""
    if not len(residuals) == len(families) == len(folds):
        raise MarginError("residuals, families and folds must have one entry per row")
    fitted: dict[tuple[str, int], Margin] = {}
    out = []
    for fam, fold in zip(families, folds, strict=True):
        if (fam, fold) not in fitted:
            calib = [r for r, f, k in zip(residuals, families, folds, strict=True)
                     if f == fam and k != fold and r is not None]
            if not calib:
                raise MarginError(f"family {fam!r}: no rows outside fold {fold} to fit a margin")
            fitted[fam, fold] = Margin.fit(fam, calib, coverage,
                                           f"split-conformal on {len(calib)} rows outside "
                                           f"fold {fold}")
        out.append(fitted[fam, fold])
    return out
