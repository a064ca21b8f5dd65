"""Analytical factorization + a LightGBM model of the residual (allocator and workspace effects).

The analytical phase walk (:mod:`phases`) predicts the allocated peak, the tensor-level replay
(:mod:`replay`) the reserved peak; LightGBM learns ``log(measured reserved / replayed reserved)``
from collected ground truth, on scale-free features (shares of each component, dtypes, flags,
log sizes), so it transfers across model families and sizes. A second LightGBM model predicts the
upper quantile of that residual's out-of-family error: the per-configuration safety margin of
the OOM verdict. Shipped as ``predictors/models/memory_residual.txt`` (+ ``.margin.txt``,
``.json``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .allocator import (
    LARGE_BUFFER,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    MiB,
)
from .factorize import Factorization, factorize
from .overheads import HOPPER, CudaOverheads
from .phases import PeakEstimate, walk_phases
from .replay import replay_reserved
from .towers import ModelSpec, TrainConfig

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
MODEL_TXT = MODELS_DIR / "memory_residual.txt"
MODEL_JSON = MODELS_DIR / "memory_residual.json"
PHASE_CODE = {"forward": 0, "backward": 1, "optimizer": 2}
ROUNDS = 300
DEFAULT_MARGIN = 0.05  # without a trained margin model
MARGIN_QUANTILE = 0.95
MIN_MARGIN = 0.01


def _segments(sizes: list[float]) -> float:
    """Reserved bytes the caching allocator's size classes imply for a set of live tensors:
    >= 10 MiB tensors get their own 2 MiB-rounded segment, 1-10 MiB tensors share 20 MiB
    segments, small ones share 2 MiB segments (a packing estimate, no fragmentation)."""
    large = sum(ROUND_LARGE * math.ceil(x / ROUND_LARGE) for x in sizes if x >= MIN_LARGE_ALLOC)
    mid = sum(x for x in sizes if SMALL_SIZE < x < MIN_LARGE_ALLOC)
    small = sum(max(x, 512) for x in sizes if x <= SMALL_SIZE)
    return large + LARGE_BUFFER * math.ceil(mid / LARGE_BUFFER) + SMALL_BUFFER * math.ceil(
        small / SMALL_BUFFER)


def packing_estimate(fz: Factorization, est: PeakEstimate) -> float:
    """Segment-level estimate of the reserved peak from the live set at the analytical peak
    (parameter/gradient/state tensors ~ per-layer weight matrices, activations ~ the layer's
    largest tensor)."""
    c = est.components
    sizes: list[float] = []
    for x in fz.layers:
        mats = max(x.tensors // 2, 1)
        per = x.param_bytes / mats
        sizes += [per] * mats  # parameters
        if x.trainable:
            k = c["optimizer_states"] / max(c["parameters"], 1)
            sizes += [per * k / 2] * (2 * mats)
            if c["gradients"]:
                sizes += [per * c["gradients"] / max(c["parameters"], 1)] * mats
        if x.saved and x.largest:
            n = max(int(x.saved // x.largest), 1)
            sizes += [x.saved / n] * n
    sizes += [c["transient"]] if c["transient"] else []
    sizes += [c["workspace"] / 2] * 2 if c["workspace"] else []
    return _segments(sizes)


def features(spec: ModelSpec, cfg: TrainConfig, overheads: CudaOverheads = HOPPER
             ) -> tuple[dict[str, float], PeakEstimate, int]:
    """Residual features, the analytical estimate, and the allocator replay's reserved peak
    (the base the residual multiplies)."""
    fz = factorize(spec, cfg)
    est = walk_phases(spec, cfg, overheads, fz)
    total = max(est.peak_allocated, 1)
    replayed = replay_reserved(fz, cfg, overheads)
    p = cfg.prec
    largest = max((x.largest for x in fz.layers), default=0)
    f = {
        "log_analytic": math.log(total),
        **{f"share_{k}": v / total for k, v in est.components.items()},
        "param_bytes": p.param_dtype.itemsize,
        "autocast": float(p.autocast),
        "masters": float(p.master_weights_fp32),
        "checkpointing": float(cfg.checkpointing == "full"),
        "eager": float(cfg.attention == "eager"),
        "frozen_share": sum(x.params for x in fz.layers if not x.trainable)
        / max(sum(x.params for x in fz.layers), 1),
        "log_tensors": math.log(fz.num_param_tensors + 1),
        "log_largest_share": math.log((largest + 1) / total),
        "loss_share": (fz.loss_saved + fz.loss_transient) / total,
        "peak_phase": PHASE_CODE.get(est.peak_phase, 0),
        # allocator regime: where typical tensors fall w.r.t. the 1 MiB / 10 MiB size classes
        "log_act_tensor_mib": math.log2(largest / MiB + 1e-3),
        "log_param_tensor_mib": math.log2(
            max(x.param_bytes / max(x.tensors, 1) for x in fz.layers) / MiB + 1e-3),
        "log_total_mib": math.log2(total / MiB),
        "num_layers": float(len(fz.layers)),
        "log_packing_ratio": math.log(packing_estimate(fz, est) / total),
        "log_replay_ratio": math.log(replayed / total),
    }
    return f, est, replayed


def _lgb_params(**extra) -> dict:
    return {"objective": "regression_l1", "learning_rate": 0.05, "num_leaves": 8,
            "min_data_in_leaf": 4, "verbose": -1, "seed": 0, "deterministic": True,
            "num_threads": 1, **extra}


def _train(x: np.ndarray, y: np.ndarray, names: list[str], **extra):
    import lightgbm as lgb

    return lgb.train(_lgb_params(**extra), lgb.Dataset(x, y, feature_name=names),
                     num_boost_round=ROUNDS)


@dataclass
class MemoryModel:
    """``predicted reserved = replayed reserved x exp(residual)``; ``margin`` is the predicted
    relative uncertainty (an upper quantile of out-of-fold errors) the OOM verdict adds."""

    booster: object | None
    feature_names: list[str]
    trained_on: str = ""
    margin_booster: object | None = None
    margin_offset: float = 0.0  # cross-conformal correction of the quantile model (log units)

    def residual(self, feats: dict[str, float]) -> float:
        if self.booster is None:
            return 0.0
        return float(self.booster.predict(self._row(feats))[0])

    def margin(self, feats: dict[str, float]) -> float:
        """Relative safety margin for this configuration (``DEFAULT_MARGIN`` without a model)."""
        if self.margin_booster is None:
            return DEFAULT_MARGIN
        upper = float(self.margin_booster.predict(self._row(feats))[0]) + self.margin_offset
        return max(math.exp(upper) - 1.0, MIN_MARGIN)

    def _row(self, feats: dict[str, float]) -> np.ndarray:
        return np.array([[feats[k] for k in self.feature_names]])

    def predict(self, spec: ModelSpec, cfg: TrainConfig, overheads: CudaOverheads = HOPPER
                ) -> tuple[int, PeakEstimate, float]:
        """(predicted peak reserved, analytical estimate, safety margin)."""
        feats, est, replayed = features(spec, cfg, overheads)
        return int(replayed * math.exp(self.residual(feats))), est, self.margin(feats)

    def predict_reserved(self, spec: ModelSpec, cfg: TrainConfig,
                         overheads: CudaOverheads = HOPPER) -> int:
        return self.predict(spec, cfg, overheads)[0]

    @classmethod
    def fit(cls, pairs: list[tuple[ModelSpec, TrainConfig, int]], trained_on: str = "",
            overheads: CudaOverheads = HOPPER) -> MemoryModel:
        """Residual model on all ``pairs``; the margin model learns the upper quantile of the
        residual's errors out of fold, with each model family held out in turn (the same way
        a new family is met in use), so it is never fit on errors of rows it has seen. A
        quantile model is itself over-confident on families it has not seen, so its bound is
        raised by the ``MARGIN_QUANTILE`` quantile of its own out-of-family shortfalls
        (cross-conformal calibration)."""
        rows, y, fams = [], [], []
        for spec, cfg, measured in pairs:
            feats, _, replayed = features(spec, cfg, overheads)
            rows.append(feats)
            y.append(math.log(measured / replayed))
            fams.append(spec.family)
        names = list(rows[0])
        x = np.array([[r[k] for k in names] for r in rows])
        y = np.array(y)
        booster = _train(x, y, names)
        fam = np.array(fams)
        err = np.zeros_like(y)
        groups = sorted(set(fams))
        for g in groups if len(groups) > 1 else []:
            out = fam == g
            err[out] = y[out] - _train(x[~out], y[~out], names).predict(x[out])
        if len(groups) < 2:
            return cls(booster, names, trained_on)
        quantile = dict(objective="quantile", alpha=MARGIN_QUANTILE)
        shortfall = np.zeros_like(y)
        for g in groups:
            out = fam == g
            q = _train(x[~out], err[~out], names, **quantile)
            shortfall[out] = err[out] - q.predict(x[out])
        offset = max(float(np.quantile(shortfall, MARGIN_QUANTILE)), 0.0)
        return cls(booster, names, trained_on, _train(x, err, names, **quantile), offset)

    def save(self, txt: Path = MODEL_TXT, meta: Path = MODEL_JSON) -> None:
        txt.parent.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(txt))
        if self.margin_booster is not None:
            self.margin_booster.save_model(str(_margin_path(txt)))
        meta.write_text(json.dumps({
            "features": self.feature_names, "trained_on": self.trained_on,
            "target": "log(peak_reserved / allocator-replay reserved peak)",
            "margin": f"quantile {MARGIN_QUANTILE} of out-of-family residual errors "
                      f"(+ cross-conformal offset), floor {MIN_MARGIN:.0%}",
            "margin_offset": self.margin_offset}, indent=1))

    @classmethod
    def load(cls, txt: Path = MODEL_TXT, meta: Path = MODEL_JSON) -> MemoryModel:
        """The shipped model; without one, the allocator replay alone (residual 0)."""
        if not txt.exists():
            return cls(None, [], "none (allocator replay only)")
        import lightgbm as lgb

        m = json.loads(meta.read_text())
        margin = _margin_path(txt)
        return cls(lgb.Booster(model_file=str(txt)), m["features"], m["trained_on"],
                   lgb.Booster(model_file=str(margin)) if margin.exists() else None,
                   m.get("margin_offset", 0.0))


def _margin_path(txt: Path) -> Path:
    return txt.with_name(txt.stem + ".margin.txt")
