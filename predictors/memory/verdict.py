"""The OOM verdict: ``fits`` / ``tight`` / ``oom`` from a prediction and a calibrated margin.

A point estimate compared with the capacity promises nothing, so the verdict compares an
interval, a lower and an upper bound of the predicted reserved bytes, with the *usable*
capacity, what is left of the card after everything outside the caching allocator (CUDA
context, cuDNN's kernels, NCCL). ``fits``: the upper bound is within the usable capacity;
``oom``: even the lower bound exceeds it; ``tight``: in between (launching it is a gamble the
prediction cannot settle).

Margins are split-conformal bounds of one family of work's errors (``dense`` and ``conv`` for
the traced module path, ``multimodal``, ``text`` and ``vision`` for the presets: their errors
differ, conv nets' by cuDNN's transient workspaces), each with a nominal coverage per side and
the number of rows it was fitted on: relative bounds of ``measured / predicted - 1``, and, for a
margin with a ``scale``, absolute bounds in bytes of ``measured - predicted`` for predictions
below it, each fitted on its own rows (Mondrian split-conformal by size): a small job's error
is an allocator segment or two, not a share of its size, and a relative margin fitted on
large jobs is too narrow for it on the upper side and, with any fixed slack under the card,
wrong on the lower one (small jobs that ran called ``oom``). Families are registered
(:func:`register_margin`); the shipped ones live in ``predictors/models/memory_margins.json``
(``dense``/``conv`` written by the memory benchmark's ``--write-margins``, ``multimodal``/
``text``/``vision`` by the preset model's training). An evaluation fits them inside each fold
without the scored rows (:func:`cross_fitted`).

The two sides guard against different harms, so each has its own coverage, set a priori from
what issue 45 tolerates of that harm (not chosen from any benchmark figure): the upper bound
decides ``fits``, and a measured peak above it launches a job that crashes (tolerated: none),
so it is the 99% rank (:data:`FITS_COVERAGE`); the lower bound decides ``oom``, and a measured
peak below it only makes a user shrink a job that would have run, which the issue budgets at
5% of the jobs that fit, so it is the 95% rank (:data:`OOM_COVERAGE`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from .allocator import GiB, MiB

# nominal P(measured <= upper bound): the upper bound decides ``fits``, whose miss crashes a job
FITS_COVERAGE = 0.99
# nominal P(measured >= lower bound): the lower bound decides ``oom``, whose miss only makes a
# user shrink a job that would have run; issue 45 budgets false ``oom`` at 5%
OOM_COVERAGE = 0.95
MARGINS_JSON = Path(__file__).resolve().parents[1] / "models" / "memory_margins.json"
MARGINS_NOTE = ("dense/conv: benchmarks/bench_memory_predictor.py --write-margins; "
                "multimodal/text/vision: python -m predictors.memory.train; residual = "
                "measured reserved / predicted - 1 (absolute: measured - predicted bytes, "
                "predictions below scale)")


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
    """Bounds around a predicted reserved peak: the measured peak lies in ``[predicted x (1 +
    lower), predicted x (1 + upper)]``, or for a prediction below ``scale`` bytes in
    ``[predicted + absolute[0], predicted + absolute[1]]``: the measured peak is below the
    lower bound with probability at most ``1 - lower_coverage`` and above the upper bound with
    probability at most ``1 - upper_coverage`` (nominal; ``rows`` errors calibrated it, 0
    where the calibration did not record its count)."""

    family: str
    lower: float  # <= 0
    upper: float  # >= 0
    # each side's nominal coverage; None on both: a fixed margin, no coverage is claimed
    lower_coverage: float | None  # the oom side
    upper_coverage: float | None  # the fits side
    rows: int
    source: str
    scale: int = 0  # bytes: predictions below it take the absolute bounds
    absolute: tuple[int, int] = (0, 0)  # (lower <= 0, upper >= 0) bytes, below ``scale``

    def __post_init__(self) -> None:
        if not -1.0 < self.lower <= 0.0 <= self.upper:
            raise MarginError(f"margin {self.family}: need -1 < lower <= 0 <= upper, got "
                              f"lower={self.lower} upper={self.upper}")
        if self.scale < 0 or not self.absolute[0] <= 0 <= self.absolute[1]:
            raise MarginError(f"margin {self.family}: need scale >= 0 and absolute[0] <= 0 <= "
                              f"absolute[1], got scale={self.scale} absolute={self.absolute}")
        if (self.lower_coverage is None) != (self.upper_coverage is None):
            raise MarginError(f"margin {self.family}: a coverage on both sides or on neither "
                              f"(a fixed margin), got lower_coverage={self.lower_coverage} "
                              f"upper_coverage={self.upper_coverage}")
        for side, c in (("lower", self.lower_coverage), ("upper", self.upper_coverage)):
            if c is not None and not 0.5 < c < 1.0:
                raise MarginError(f"margin {self.family}: {side}_coverage={c} must be in "
                                  "(0.5, 1)")

    @classmethod
    def fixed(cls, relative: float, family: str = "fixed") -> Margin:
        """A user's fixed margin ``+-relative`` (no coverage claimed)."""
        if not 0.0 <= relative < 1.0:
            raise MarginError(f"margin={relative} must be in [0, 1)")
        return cls(family, -relative, relative, None, None, 0, f"fixed +-{relative:.1%}")

    @classmethod
    def fit(cls, family: str, residuals: Sequence[float], *,
            lower_coverage: float = OOM_COVERAGE, upper_coverage: float = FITS_COVERAGE,
            source: str = "") -> Margin:
        """Split-conformal bounds of ``residuals`` (``measured / predicted - 1``): the upper
        bound at ``upper_coverage``, the lower one at ``lower_coverage`` of the negated
        residuals."""
        lower, upper = _bounds(residuals, lower_coverage, upper_coverage)
        return cls(family, max(lower, -0.99), upper, lower_coverage, upper_coverage,
                   len(residuals), source or f"split-conformal, {len(residuals)} residuals")

    @classmethod
    def fit_sized(cls, family: str, predicted: Sequence[float], measured: Sequence[float],
                  scale: int, *, lower_coverage: float = OOM_COVERAGE,
                  upper_coverage: float = FITS_COVERAGE, source: str = "") -> Margin:
        """Split-conformal bounds per size (Mondrian): relative ones (:meth:`fit`) on the
        predictions of at least ``scale`` bytes, absolute ones (bytes) on the smaller ones,
        each side at its own coverage; with no small rows the relative bounds at ``scale``
        stand in for them."""
        big = [m / p - 1 for p, m in zip(predicted, measured, strict=True) if p >= scale]
        if not big:
            raise MarginError(f"margin {family}: no prediction of at least scale={scale} bytes "
                              "to fit its relative bounds")
        rel = cls.fit(family, big, lower_coverage=lower_coverage, upper_coverage=upper_coverage)
        small = [m - p for p, m in zip(predicted, measured, strict=True) if p < scale]
        lo, up = (_bounds(small, lower_coverage, upper_coverage) if small
                  else (rel.lower * scale, rel.upper * scale))
        return cls(family, rel.lower, rel.upper, lower_coverage, upper_coverage,
                   len(big) + len(small),
                   source or f"split-conformal by size, {len(big)} + {len(small)} rows", scale,
                   (math.floor(lo), math.ceil(up)))

    def bounds(self, predicted: int) -> tuple[int, int]:
        """(lower, upper) bound of the reserved bytes around ``predicted``."""
        if predicted < self.scale:
            return max(predicted + self.absolute[0], 0), predicted + self.absolute[1]
        return int(predicted * (1 + self.lower)), int(predicted * (1 + self.upper))

    def largest_fitting(self, usable: int) -> int:
        """The largest prediction whose upper bound (:meth:`bounds`) is within ``usable`` bytes
        (0 if none): the relative side's inverse where it reaches ``scale``, else the absolute
        side's below ``scale`` (the upper bound may drop at ``scale``, so a relative answer
        at or above it is the larger one whenever there is one)."""
        relative = int(usable / (1 + self.upper))
        if relative >= self.scale:
            return relative
        return max(min(usable - self.absolute[1], self.scale - 1), 0)

    def describe(self) -> str:
        cov = ("no coverage claimed" if self.upper_coverage is None
               else f"coverage {self.upper_coverage:.0%} upper (fits side) / "
               f"{self.lower_coverage:.0%} lower (oom side)"
               + (f" on {self.rows} rows" if self.rows else ""))
        small = (f", {self.absolute[0] / MiB:+.0f} / {self.absolute[1] / MiB:+.0f} MiB below "
                 f"{self.scale / MiB:.0f} MiB" if self.scale else "")
        return (f"{self.family} margin {self.lower:+.1%} / {self.upper:+.1%}{small} ({cov}; "
                f"{self.source})")


def _bounds(errors: Sequence[float], lower_coverage: float,
            upper_coverage: float) -> tuple[float, float]:
    """(lower <= 0, upper >= 0) split-conformal bounds of ``errors``, each side at its own
    coverage (the coverages are checked where the :class:`Margin` is built)."""
    return (min(-conformal_quantile([-e for e in errors], lower_coverage), 0.0),
            max(conformal_quantile(errors, upper_coverage), 0.0))


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
        # a file written before the sides had their own coverage has one for both
        lo, up = ((m["lower_coverage"], m["upper_coverage"]) if "upper_coverage" in m
                  else (m["coverage"], m["coverage"]))
        register_margin(Margin(family, m["lower"], m["upper"], lo, up, m["rows"], m["source"],
                               m.get("scale", 0), tuple(m.get("absolute", (0, 0)))))


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
    usable: int  # capacity - outside the allocator
    capacity: int
    margin: Margin

    def as_dict(self) -> dict[str, object]:
        return {"verdict": self.verdict.value, "reserved_lower": self.lower,
                "reserved_upper": self.upper, "usable": self.usable,
                "margin_family": self.margin.family, "margin_lower": self.margin.lower,
                "margin_upper": self.margin.upper, "margin_scale": self.margin.scale,
                "margin_absolute": list(self.margin.absolute),
                "margin_lower_coverage": self.margin.lower_coverage,
                "margin_upper_coverage": self.margin.upper_coverage,
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
    usable = capacity - outside_allocator
    lower, upper = margin.bounds(predicted_reserved)
    if upper <= usable and not out_of_memory:
        v = Verdict.FITS
    elif lower > usable:
        v = Verdict.OOM
    else:
        v = Verdict.TIGHT
    return Judgement(v, predicted_reserved, lower, upper, usable, capacity, margin)


def cross_fitted(predicted: Sequence[float], measured: Sequence[float | None],
                 families: Sequence[str], folds: Sequence[int], scale: int = 0, *,
                 lower_coverage: float = OOM_COVERAGE,
                 upper_coverage: float = FITS_COVERAGE) -> list[Margin]:
    """Per row, the margin of its family (:meth:`Margin.fit_sized` at ``scale``) fitted on the
    other folds' rows of that family only (the scored fold never calibrates its own margin).
    A row whose ``measured`` is ``None`` is judged but calibrates nothing (for example a
    crashed run with no peak)."""
    if not len(predicted) == len(measured) == len(families) == len(folds):
        raise MarginError("predicted, measured, families and folds must have one entry per row")
    rows = list(zip(predicted, measured, families, folds, strict=True))
    fitted: dict[tuple[str, int], Margin] = {}
    out = []
    for fam, fold in zip(families, folds, strict=True):
        if (fam, fold) not in fitted:
            calib = [(p, m) for p, m, f, k in rows if f == fam and k != fold and m is not None]
            if not calib:
                raise MarginError(f"family {fam!r}: no rows outside fold {fold} to fit a margin")
            fitted[fam, fold] = Margin.fit_sized(
                fam, [p for p, _ in calib], [m for _, m in calib], scale,
                lower_coverage=lower_coverage, upper_coverage=upper_coverage,
                source=f"split-conformal on {len(calib)} rows outside fold {fold}")
        out.append(fitted[fam, fold])
    return out
