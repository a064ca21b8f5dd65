"""LightGBM correction on top of the analytical estimate, one model per device family.

The booster learns ``log(measured) - log(analytical)`` from the analytical features (the
analytical estimate itself is one of them, as ``log_analytical``), so predictions are
``analytical * exp(booster)``: a tree model cannot extrapolate, but a multiplicative correction
on a roofline can, which is what held-out (larger, unseen) models need.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

LGB_PARAMS = {
    "objective": "regression_l1",  # MAPE-like: robust to the VM's slow outliers
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 5,
    "feature_fraction": 0.9,
    "bagging_fraction": 0.9,
    "bagging_freq": 1,
    "lambda_l2": 1.0,
    "num_threads": 1,
    "deterministic": True,
    "seed": 0,
    "verbose": -1,
}
NUM_ROUNDS = 400


@dataclass
class TimeModel:
    family: str
    feature_names: list[str]
    booster: object  # lightgbm.Booster
    meta: dict = field(default_factory=dict)

    def predict(self, rows: Sequence[dict[str, float]]) -> np.ndarray:
        X = np.array([[r.get(k, 0.0) for k in self.feature_names] for r in rows], dtype=float)
        base = np.array([r["log_analytical"] for r in rows])
        return np.exp(base + self.booster.predict(X, num_threads=1))

    def predict_one(self, row: dict[str, float]) -> float:
        return float(self.predict([row])[0])

    def save(self, directory: str | Path, name: str | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        name = name or f"time_{self.family}"
        self.booster.save_model(str(directory / f"{name}.txt"))
        meta = {"family": self.family, "feature_names": self.feature_names, **self.meta}
        (directory / f"{name}.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        return directory / f"{name}.json"

    @classmethod
    def load(cls, json_path: str | Path) -> TimeModel:
        import lightgbm as lgb

        json_path = Path(json_path)
        meta = json.loads(json_path.read_text())
        booster = lgb.Booster(model_file=str(json_path.with_suffix(".txt")))
        return cls(meta.pop("family"), meta.pop("feature_names"), booster, meta)


def train_time_model(rows: Sequence[dict[str, float]], seconds: Sequence[float], family: str,
                     feature_names: Sequence[str] | None = None, meta: dict | None = None,
                     rounds: int = NUM_ROUNDS) -> TimeModel:  # fmt: skip
    import lightgbm as lgb

    names = list(feature_names or sorted({k for r in rows for k in r} - {"analytical_s"}))
    X = np.array([[r.get(k, 0.0) for k in names] for r in rows], dtype=float)
    y = np.log(np.asarray(seconds, dtype=float)) - np.array([r["log_analytical"] for r in rows])
    params = {**LGB_PARAMS, "min_data_in_leaf": max(2, min(5, len(rows) // 20))}
    booster = lgb.train(params, lgb.Dataset(X, y, feature_name=names), num_boost_round=rounds)
    return TimeModel(family, names, booster, dict(meta or {}, rows=len(rows)))


def mape(pred: Sequence[float], true: Sequence[float]) -> float:
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    return float(np.mean(np.abs(p - t) / t) * 100.0)


def shipped_model_path(family: str, precision_aware: bool = True) -> Path | None:
    name = f"time_{family}" + ("" if precision_aware else "_unaware")
    path = Path(str(resources.files("predictors") / "models" / f"{name}.json"))
    return path if path.exists() else None
