"""Held-out evaluation: MAPE on configurations whose model family or size was never trained on.

Rows of one model that differ only in batch size or strategy are near-duplicates, so a random
row split would leak; every split here holds out whole groups (a family, a size). Each
evaluation is run twice: precision-aware, and the paper's ablation with the step traced at fp32
and all precision features removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from predictors.time.feature_sets import measurement_features, vtrain_features
from predictors.time.model import mape, train_time_model
from predictors.time.train import feature_names, train_vtrain_rows


@dataclass
class HeldOutResult:
    name: str
    mape: float
    per_group: dict[str, float]
    predicted: np.ndarray = field(repr=False)
    measured: np.ndarray = field(repr=False)
    constants: dict[str, dict[str, float]] = field(default_factory=dict)  # per fold, in us


# ---------------------------------------------------------------------------------------------
# vTrain (A100, Megatron, fp16 mixed)


class _VTrainFolds:
    """Train/test folds on vTrain with the host constants fitted on each fold's training rows
    (:mod:`predictors.time.calibrate`); feature rows are shared between folds that fit the same."""

    def __init__(self, rows) -> None:
        from predictors.datasets.vtrain import VTRAIN_DEVICE
        from predictors.devices import get_device

        self.rows = rows
        self.base = get_device(VTRAIN_DEVICE)
        self._feats: dict[tuple, list[dict]] = {}

    def features(self, constants: dict[str, float]) -> list[dict]:
        from predictors.time.calibrate import with_constants

        key = tuple(sorted(constants.items()))
        if key not in self._feats:
            dev = with_constants(self.base, constants)
            self._feats[key] = vtrain_features(rows=self.rows, device=dev)[1]
        return self._feats[key]

    def fold(self, train: list[int], test: list[int]) -> tuple[np.ndarray, dict[str, float]]:
        """Predictions on ``test`` of a correction (and constants) fitted on ``train`` only,
        by the one trainer of the held-out vTrain model (:func:`train_vtrain_rows`)."""
        model = train_vtrain_rows([self.rows[i] for i in train],
                                  lambda c: [self.features(c)[i] for i in train])  # fmt: skip
        constants = model.meta["device_constants"]
        return model.predict([self.features(constants)[i] for i in test]), constants

    def split(self, name: str, groups: Sequence[str],
              folds: Sequence[tuple[set[str], set[str]]]) -> HeldOutResult:  # fmt: skip
        """Pooled MAPE over ``folds`` of (train groups, test groups)."""
        y = np.array([r.seconds for r in self.rows])
        preds, trues, per_group, fitted = [], [], {}, {}
        for train_g, test_g in folds:
            train = [i for i, g in enumerate(groups) if g in train_g]
            test = [i for i, g in enumerate(groups) if g in test_g]
            pred, constants = self.fold(train, test)
            label = "+".join(sorted(test_g))
            per_group[label] = mape(pred, y[test])
            fitted[label] = {k: v * 1e6 for k, v in constants.items()}
            preds.append(pred)
            trues.append(y[test])
        pred, true = np.concatenate(preds), np.concatenate(trues)
        return HeldOutResult(name, mape(pred, true), per_group, pred, true, fitted)


def evaluate_vtrain() -> dict[str, HeldOutResult]:
    """vTrain splits, every constant fitted inside the fold:

    * ``unseen_hidden`` (headline): train on one hidden size, test on the other, both
      directions (h1024 -> h2048 and h2048 -> h1024), pooled;
    * ``by_depth`` (secondary): leave one (hidden, depth) group out; its hidden size is seen
      at three other depths, so this is interpolation;
    * ``analytical_only``: the roofline with the shipped constants, no correction.

    vTrain has one sequence length (1024), one head count (16) and one precision: unseen
    sequence length, head count and precision are scored on the CPU measurements."""
    from predictors.datasets.vtrain import load_vtrain

    folds = _VTrainFolds(load_vtrain())
    rows = folds.rows
    hidden = [f"h{r.spec.hidden_size}" for r in rows]
    hs = sorted(set(hidden))
    unseen = folds.split("vtrain_unseen_hidden", hidden,
                         [({a}, {b}) for a in hs for b in hs if a != b])  # fmt: skip
    sizes = [r.size for r in rows]
    all_sizes = set(sizes)
    by_depth = folds.split("vtrain_by_depth", sizes, [(all_sizes - {g}, {g}) for g in sorted(all_sizes)])
    analytical = mape([f["analytical_s"] for f in vtrain_features(rows=rows)[1]],
                      [r.seconds for r in rows])  # fmt: skip
    return {"unseen_hidden": unseen, "by_depth": by_depth,
            "analytical_only": HeldOutResult("vtrain_analytical", analytical, {},
                                             np.array([]), np.array([]))}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Local measurements (predict collect)


def size_tier(model: str) -> str:
    """``gpt-s`` -> ``s``: the size suffix of a zoo name."""
    return model.rsplit("-", 1)[-1]


class _CpuFolds:
    """Train/test folds on measured CPU rows with the per-kernel cost fitted on each fold's
    training rows (:func:`predictors.time.calibrate.fit_cpu_constants`)."""

    def __init__(self, df, device, precision_aware: bool, cache: str | Path | None) -> None:
        self.df, self.device, self.aware, self.cache = df, device, precision_aware, cache
        self.y = df["seconds"].to_numpy()
        self._feats: dict[tuple, list[dict]] = {}
        self.names: list[str] | None = None

    def features(self, constants: dict[str, float]) -> list[dict]:
        from predictors.time.calibrate import with_constants

        key = tuple(sorted(constants.items()))
        if key not in self._feats:
            dev = with_constants(self.device, constants)
            self._feats[key] = measurement_features(self.df, self.aware, dev, self.cache)
            if self.names is None:  # precision features only where rows span > 1 precision
                precisions = list(self.df["precision"]) if self.aware else ["fp32"]
                self.names = feature_names(self._feats[key], precisions)
        return self._feats[key]

    def fold(self, train: list[int], test: list[int], family: str
             ) -> tuple[np.ndarray, dict[str, float]]:  # fmt: skip
        from predictors.time.calibrate import fit_cpu_constants

        constants = fit_cpu_constants(self.df.iloc[train], self.device, self.aware)
        feats = self.features(constants)
        model = train_time_model([feats[i] for i in train], self.y[train], family, self.names)
        return model.predict([feats[i] for i in test]), constants

    def leave_group_out(self, name: str, groups: Sequence[str], family: str) -> HeldOutResult:
        """Train on all groups but one, predict that one; every group in turn (predictions
        aligned with the rows)."""
        pred = np.zeros(len(self.y))
        per_group, fitted = {}, {}
        for g in sorted(set(groups)):
            train = [i for i, x in enumerate(groups) if x != g]
            test = [i for i, x in enumerate(groups) if x == g]
            pred[test], constants = self.fold(train, test, family)
            per_group[g] = mape(pred[test], self.y[test])
            fitted[g] = {k: v * 1e6 for k, v in constants.items()}
        return HeldOutResult(name, mape(pred, self.y), per_group, pred, self.y, fitted)

    def unseen_seq(self, seqs: list[int], family: str) -> HeldOutResult:
        """Hold out each sequence length of the sequence models in turn (rows without one,
        seq 0, always train), pooled."""
        preds, trues, per, fitted = [], [], {}, {}
        for s in sorted({v for v in seqs if v > 0}):
            train = [i for i, v in enumerate(seqs) if v != s]
            test = [i for i, v in enumerate(seqs) if v == s]
            pred, constants = self.fold(train, test, family)
            per[f"seq{s}"] = mape(pred, self.y[test])
            fitted[f"seq{s}"] = {k: v * 1e6 for k, v in constants.items()}
            preds.append(pred)
            trues.append(self.y[test])
        pred, true = np.concatenate(preds), np.concatenate(trues)
        return HeldOutResult("by_seq", mape(pred, true), per, pred, true, fitted)


def evaluate_measurements(df, device, family: str = "cpu",
                          cache: str | Path | None = None) -> dict[str, HeldOutResult]:  # fmt: skip
    """Leave-one-family-out and leave-one-size-tier-out, precision-aware vs precision-unaware;
    precision-aware also leave-one-precision-out (``by_precision``: a precision the correction
    never saw) and unseen sequence length (``by_seq``). The per-kernel cost is fitted inside
    every fold.

    A size tier (``xs``, ``s``, ``m``) is held out across ALL families at once: ``gpt-s``,
    ``bert-s`` and ``llama-s`` share a shape, so holding out one model leaves its twins in."""
    df = df.reset_index(drop=True)
    tiers = [size_tier(m) for m in df["model"]]
    results = {}
    for aware in (True, False):
        folds = _CpuFolds(df, device, aware, cache)
        tag = "" if aware else "_unaware"
        results["by_family" + tag] = folds.leave_group_out("by_family" + tag,
                                                           list(df["family"]), family)  # fmt: skip
        results["by_size" + tag] = folds.leave_group_out("by_size" + tag, tiers, family)
        if aware:
            results["by_precision"] = folds.leave_group_out("by_precision",
                                                            list(df["precision"]), family)  # fmt: skip
            results["by_seq"] = folds.unseen_seq([int(v) for v in df["seq"]], family)
    return results


def scatter_by_precision(result: HeldOutResult, precisions: Sequence[str], out_dir: str | Path,
                         title: str) -> Path:  # fmt: skip
    """Predicted-vs-measured scatter, one colour per precision, to ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 6))
    precisions = np.asarray(list(precisions))
    for p in sorted(set(precisions)):
        m = precisions == p
        err = mape(result.predicted[m], result.measured[m])
        ax.scatter(result.measured[m] * 1e3, result.predicted[m] * 1e3, s=12,
                   label=f"{p} (MAPE {err:.1f}%)")  # fmt: skip
    lo = min(result.measured.min(), result.predicted.min()) * 1e3
    hi = max(result.measured.max(), result.predicted.max()) * 1e3
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="measured iteration time (ms)",
           ylabel="predicted iteration time (ms)", title=f"{title}: MAPE {result.mape:.2f}%")  # fmt: skip
    ax.legend(fontsize=7)
    path = out_dir / f"{result.name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Development fleet (published GPU runs; predictors.datasets.fleet)


@dataclass
class FleetResult:
    name: str
    mape: float
    per_group: dict[str, float]
    rows: list[tuple[str, float, float]]  # (row name, predicted, measured)
    efficiencies: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def per_row(self) -> list[tuple[str, float, float, float]]:
        return [(n, p, m, 100.0 * (p - m) / m) for n, p, m in self.rows]


class FleetFolds:
    """Held-out splits over fleet rows: per device family, the kernel efficiencies and the
    factors of the frameworks with training rows (:class:`predictors.time.efficiency_fit.
    EfficiencyFit`) are fitted on the fold's training rows only and the held-out rows are priced
    with them; a framework without training rows in the fold (held out) is priced as the
    family's typical framework (factors 1). ``fitter(family_rows)`` builds the fitter (a test
    passes one that records what it was fitted on)."""

    def __init__(self, rows, fitter=None) -> None:
        from predictors.time.efficiency_fit import EfficiencyFit

        self.rows = list(rows)
        by_family: dict[str, list[int]] = {}
        for i, r in enumerate(self.rows):
            by_family.setdefault(r.fit_group.split("/")[0], []).append(i)
        self.family_index = by_family
        self._make = fitter or EfficiencyFit
        self.fits: dict[str, object] = {}
        self._cache: dict[tuple[str, frozenset], dict[str, float]] = {}

    def _fit(self, family: str):
        if family not in self.fits:
            self.fits[family] = self._make([self.rows[i] for i in self.family_index[family]])
        return self.fits[family]

    def _fitted(self, family: str, train: set[int]) -> dict[str, float]:
        local = frozenset(j for j, i in enumerate(self.family_index[family]) if i in train)
        key = (family, local)
        if key not in self._cache:
            self._cache[key] = self._fit(family).fit(sorted(local))
        return self._cache[key]

    def predict(self, train: set[int], test: list[int], defaults: bool = False
                ) -> tuple[dict[int, float], dict]:  # fmt: skip
        """Predictions on ``test`` of efficiencies fitted on ``train`` per device family (with
        ``defaults`` the roofline's default efficiencies instead, nothing fitted)."""
        out, fitted, wanted = {}, {}, set(test)
        for family, idx in self.family_index.items():
            held = [j for j, i in enumerate(idx) if i in wanted]
            if not held:
                continue
            eff = {} if defaults else self._fitted(family, train)
            fitted[family] = eff
            for j, p in zip(held, self._fit(family).predict(eff, held), strict=True):
                out[idx[j]] = p
        return out, fitted

    def leave_group_out(self, name: str, groups: Sequence[str], defaults: bool = False
                        ) -> FleetResult:  # fmt: skip
        preds: dict[int, float] = {}
        per_group, fitted = {}, {}
        everything = set(range(len(self.rows)))
        for g in sorted(set(groups), key=str):
            test = [i for i, x in enumerate(groups) if x == g]
            pred, fitted[str(g)] = self.predict(everything - set(test), test, defaults)
            preds.update(pred)
            per_group[str(g)] = mape([pred[i] for i in test], [self.rows[i].seconds for i in test])
        return self._result(name, preds, per_group, fitted)

    def _result(self, name, preds, per_group, fitted) -> FleetResult:
        order = sorted(preds)
        rows = [(self.rows[i].name, preds[i], self.rows[i].seconds) for i in order]
        return FleetResult(name, mape([p for _, p, _ in rows], [m for _, _, m in rows]),
                           per_group, rows, fitted)  # fmt: skip


def pair_error(result: FleetResult, rows) -> FleetResult:
    """Mean |predicted / measured - 1| (%) of the t_bf16 / t_fp8 ratio of every precision pair
    in ``rows``, from ``result``'s held-out predictions of both runs."""
    from predictors.datasets.fleet import precision_pairs

    pred = {n: p for n, p, _ in result.rows}
    out = [(f"{a.name} / {b.precision}", pred[a.name] / pred[b.name], a.seconds / b.seconds)
           for a, b in precision_pairs(rows)]  # fmt: skip
    err = float(np.mean([abs(p / m - 1) for _, p, m in out]) * 100) if out else float("nan")
    return FleetResult("fleet_pair_error", err, {}, out)


def evaluate_fleet(fitter=None) -> dict[str, FleetResult]:
    """Development splits over the ``develop`` fleet rows, efficiencies fitted inside every
    fold (development figures: the data and the model were iterated on while looking at them):

    * ``new_model``: leave one model out (a new model on a known fleet);
    * ``new_gpus``: leave one GPU count out;
    * ``new_framework``: leave one framework out (its rows priced with their device family's
      efficiencies fitted on the other frameworks' rows, as the typical framework: how far
      the device's efficiencies transfer); ``new_framework_defaults`` the same rows at the
      roofline's default efficiencies;
    * ``pair_error``: the bf16/fp8 speed ratio of each pair from the leave-one-model-out
      predictions (both runs of a pair belong to the held-out model);
    * ``megatron_h100``: ``new_model``'s predictions of the Megatron-LM H100 table's rows;
    * ``context_parallel``: ``new_model``'s predictions of the rows with CP > 1 (ring
      attention)."""
    from predictors.datasets.fleet import MEGATRON_CSV, load_fleet

    rows = load_fleet("develop")
    folds = FleetFolds(rows, fitter)
    new_model = folds.leave_group_out("fleet_new_model", [r.model for r in rows])
    new_gpus = folds.leave_group_out("fleet_new_gpus", [str(r.gpus) for r in rows])
    frameworks = [r.fit_group.split("/")[1] for r in rows]
    new_framework = folds.leave_group_out("fleet_new_framework", frameworks)
    unborrowed = folds.leave_group_out("fleet_new_framework_defaults", frameworks, defaults=True)
    return {"new_model": new_model, "new_gpus": new_gpus, "new_framework": new_framework,
            "new_framework_defaults": unborrowed,
            "pair_error": pair_error(new_model, rows),
            "megatron_h100": _rows_of(new_model, "megatron_h100",
                                      {r.name for r in rows if r.source == MEGATRON_CSV}),
            "context_parallel": _rows_of(new_model, "context_parallel",
                                         {r.name for r in rows if r.strategy.cp > 1})}  # fmt: skip


def _rows_of(result: FleetResult, name: str, names: set[str]) -> FleetResult:
    """``result``'s predictions of the rows ``names`` and their MAPE."""
    picked = [row for row in result.rows if row[0] in names]
    return FleetResult(name, mape([p for _, p, _ in picked], [m for _, _, m in picked]), {},
                       picked)  # fmt: skip


def evaluate_fleet_final(fitter=None) -> FleetResult:
    """The frozen final split (``use == "final"`` rows: chosen before any efficiency was
    fitted and never fitted or selected on), priced with efficiencies fitted on every
    development row. Score it once and report it as such."""
    from predictors.datasets.fleet import load_fleet

    dev, final = load_fleet("develop"), load_fleet("final")
    folds = FleetFolds(dev + final, fitter)
    test = list(range(len(dev), len(dev) + len(final)))
    pred, fitted = folds.predict(set(range(len(dev))), test)
    per = {r.source: mape([pred[i] for i in test if folds.rows[i].source == r.source],
                          [folds.rows[i].seconds for i in test
                           if folds.rows[i].source == r.source]) for r in final}  # fmt: skip
    return folds._result("fleet_final", pred, per, {"all_development": fitted})


@dataclass
class PublicResult:
    name: str
    error: float  # MAPE (%) of times, or mean absolute % error of ratios
    rows: list[tuple[str, float, float]]  # (row, predicted, measured)

    def per_row(self) -> list[tuple[str, float, float, float]]:
        return [(n, p, m, 100.0 * (p - m) / m) for n, p, m in self.rows]


def evaluate_precision_pairs() -> PublicResult:
    """Error of the predicted speed ratio of each bf16/fp8 pair against the measured one, priced
    by the roofline with its default efficiencies: never fitted on these pairs. (The shipped
    fleet-fitted efficiencies were fitted on these very rows; their held-out pair error is the
    fleet split's, :func:`pair_error`.)"""
    from predictors.datasets.fleet import load_llm_foundry_pairs
    from predictors.time.predictor import predict_with_model

    rows = []
    for p in load_llm_foundry_pairs():
        ref = predict_with_model(None, p.spec, p.strategy, p.reference, p.device, options=p.options)
        fast = predict_with_model(None, p.spec, p.strategy, p.fast, p.device, options=p.options)
        rows.append((p.name, ref / fast, p.measured_ratio))
    pred, true = np.array([p for _, p, _ in rows]), np.array([t for _, _, t in rows])
    return PublicResult("llm_foundry_bf16_fp8_ratio",
                        float(np.mean(np.abs(pred - true) / true) * 100), rows)  # fmt: skip
