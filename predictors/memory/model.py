"""Analytical factorization + a LightGBM model of the residual (allocator and workspace effects).

The analytical phase walk (:mod:`phases`) predicts the allocated peak; LightGBM learns
``log(measured reserved peak / analytical peak)`` from collected ground truth, on features that
are scale-free (shares of each component, dtypes, flags, log sizes), so it transfers across
model families and sizes. Shipped as ``predictors/models/memory_residual.txt`` (+ ``.json``)."""

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
             ) -> tuple[dict[str, float], PeakEstimate]:
    fz = factorize(spec, cfg)
    est = walk_phases(spec, cfg, overheads, fz)
    total = max(est.peak_allocated, 1)
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
        "log_replay_ratio": math.log(replay_reserved(fz, cfg, overheads) / total),
    }
    return f, est


@dataclass
class MemoryModel:
    booster: object | None
    feature_names: list[str]
    trained_on: str = ""

    def residual(self, feats: dict[str, float]) -> float:
        if self.booster is None:
            return 0.0
        x = np.array([[feats[k] for k in self.feature_names]])
        return float(self.booster.predict(x)[0])

    def predict_reserved(self, spec: ModelSpec, cfg: TrainConfig,
                         overheads: CudaOverheads = HOPPER) -> tuple[int, PeakEstimate, float]:
        feats, est = features(spec, cfg, overheads)
        r = self.residual(feats)
        return int(est.peak_allocated * math.exp(r)), est, r

    @classmethod
    def fit(cls, pairs: list[tuple[ModelSpec, TrainConfig, int]], trained_on: str = "",
            overheads: CudaOverheads = HOPPER) -> MemoryModel:
        import lightgbm as lgb

        rows, y = [], []
        for spec, cfg, measured in pairs:
            feats, est = features(spec, cfg, overheads)
            rows.append(feats)
            y.append(math.log(measured / est.peak_allocated))
        names = list(rows[0])
        x = np.array([[r[k] for k in names] for r in rows])
        booster = lgb.train(
            {"objective": "regression_l1", "learning_rate": 0.05, "num_leaves": 8,
             "min_data_in_leaf": 4, "verbose": -1, "seed": 0, "deterministic": True,
             "num_threads": 1},
            lgb.Dataset(x, np.array(y), feature_name=names), num_boost_round=300)
        return cls(booster, names, trained_on)

    def save(self, txt: Path = MODEL_TXT, meta: Path = MODEL_JSON) -> None:
        txt.parent.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(txt))
        meta.write_text(json.dumps({"features": self.feature_names,
                                    "trained_on": self.trained_on,
                                    "target": "log(peak_reserved / analytical peak)"}, indent=1))

    @classmethod
    def load(cls, txt: Path = MODEL_TXT, meta: Path = MODEL_JSON) -> MemoryModel:
        """The shipped model; without one, the analytical estimate alone (residual 0)."""
        if not txt.exists():
            return cls(None, [], "none (analytical only)")
        import lightgbm as lgb

        m = json.loads(meta.read_text())
        return cls(lgb.Booster(model_file=str(txt)), m["features"], m["trained_on"])
