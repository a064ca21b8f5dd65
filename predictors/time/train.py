"""Training the learned corrections (the public training API; ``predict train`` calls it).

* :func:`train_vtrain_model` — the GPU (A100 family) correction on vTrain's measured Megatron
  times. ``exclude`` drops rows, e.g. a model-size group, so a caller (CONA's benchmark) can
  train a variant that never saw what it will be asked about.
* :func:`train_measurement_model` — the CPU correction on ``predict collect`` measurements,
  with the same kind of ``exclude`` (a pandas row predicate).
* :func:`train_fleet_efficiencies` — kernel efficiencies per device family and framework on
  the development fleet rows (the correction of device families without a LightGBM model,
  H100 included).

A data set measured at one precision says nothing about precision: its precision features are
constant or just stand in for model size. Features that describe precision are therefore only
given to the booster when the training rows span more than one precision; precision effects on
a GPU then come from the roofline's per-dtype rates alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from predictors.datasets.vtrain import VTrainRow
from predictors.time.features import precision_feature_names
from predictors.time.model import TimeModel, train_time_model

VTRAIN_META = ("predictors/data/ground_truth_single.csv (vTrain: 1,440 Megatron GPT iteration "
               "times on A100, fp16 mixed; MIT licence in data/LICENSE.vtrain)")  # fmt: skip


def feature_names(rows: Sequence[dict], precisions: Sequence[str]) -> list[str]:
    names = sorted({k for r in rows for k in r} - {"analytical_s"})
    if len(set(precisions)) < 2:
        drop = precision_feature_names()
        names = [n for n in names if n not in drop]
    return names


def train_vtrain_rows(rows: Sequence[VTrainRow],
                      features_for: Callable[[dict[str, float]], list[dict]] | None = None,
                      meta: dict | None = None) -> TimeModel:  # fmt: skip
    """The one trainer of the A100 correction on vTrain rows — the shipped model, every
    held-out fold of :mod:`predictors.time.evaluate` and CONA's held-out predictor: the host
    constants fitted on ``rows`` (kept in ``meta["device_constants"]``), the rows' features
    under them, LightGBM on those. ``features_for(constants)`` gives the feature rows of
    ``rows`` (a caller with a cache shares it); default: computed here."""
    from predictors.datasets.vtrain import VTRAIN_DEVICE, VTRAIN_PRECISION
    from predictors.devices import get_device
    from predictors.time.calibrate import fit_gpu_constants, with_constants
    from predictors.time.feature_sets import vtrain_features

    if not rows:
        raise ValueError("no vTrain rows to train on")
    base = get_device(VTRAIN_DEVICE)
    constants = fit_gpu_constants(rows, VTRAIN_PRECISION, base)
    feats = (features_for(constants) if features_for
             else vtrain_features(rows=rows, device=with_constants(base, constants))[1])  # fmt: skip
    names = feature_names(feats, [VTRAIN_PRECISION])
    return train_time_model(feats, [r.seconds for r in rows], "a100", names,
                            {**(meta or {}), "device_constants": constants})  # fmt: skip


def train_vtrain_model(exclude: Callable[[VTrainRow], bool] | None = None,
                       rows: Sequence[VTrainRow] | None = None) -> TimeModel:  # fmt: skip
    """The A100 correction trained on vTrain rows for which ``exclude(row)`` is false
    (:func:`train_vtrain_rows`).

    Example (hold out one model size): ``train_vtrain_model(lambda r: r.size == "h2048-l24")``;
    ``r.spec`` and ``r.strategy`` are the row's :class:`TransformerSpec` and
    :class:`ParallelStrategy`."""
    from predictors.datasets.vtrain import VTRAIN_DEVICE, load_vtrain

    every = list(rows if rows is not None else load_vtrain())
    kept = [r for r in every if not (exclude and exclude(r))]
    if not kept:
        raise ValueError("exclude removed every vTrain row; nothing to train on")
    meta = {"training_data": VTRAIN_META, "device": VTRAIN_DEVICE, "precision_aware": True,
            "excluded_rows": len(every) - len(kept)}  # fmt: skip
    return train_vtrain_rows(kept, meta=meta)


def train_measurement_model(data: str | Path, precision_aware: bool = True,
                            exclude: Callable | None = None) -> TimeModel:  # fmt: skip
    """The CPU correction trained on a ``predict collect`` CSV (rows where ``exclude(row)``,
    a pandas row, is true are left out). The per-kernel cost is fitted on the same rows and
    kept in ``meta["device_constants"]``."""
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.time.calibrate import fit_cpu_constants, with_constants
    from predictors.time.collect import device_profile_path, features_cache_path
    from predictors.time.feature_sets import measurement_features

    data = Path(data)
    df = load_measurements(data)
    if exclude is not None:
        df = df[~df.apply(exclude, axis=1)]
    profile = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    constants = fit_cpu_constants(df, profile, precision_aware)
    feats = measurement_features(df, precision_aware, with_constants(profile, constants),
                                 features_cache_path(data))  # fmt: skip
    meta = {"training_data": f"{data.name} ({len(df)} CPU measurements, predict collect)",
            "device_profile": profile.to_dict(), "precision_aware": precision_aware,
            "device_constants": constants}  # fmt: skip
    names = feature_names(feats, list(df["precision"]) if precision_aware else ["fp32"])
    return train_time_model(feats, df["seconds"].to_numpy(), "cpu", names, meta)


def train_fleet_efficiencies(out_dir: str | Path) -> Path:
    """Kernel efficiencies per device family and its frameworks' factors fitted on every
    ``develop`` fleet row (:mod:`predictors.datasets.fleet`,
    :func:`predictors.time.efficiency_fit.fit_by_family`), written to
    ``out_dir/efficiency.json``. The ``final`` rows are never fitted on."""
    from predictors.datasets.fleet import load_fleet
    from predictors.time.efficiency_fit import fit_by_family

    rows = load_fleet("develop")
    sources = list(dict.fromkeys(r.source for r in rows))  # in load order
    blob = {"training_data": f"develop rows of {', '.join(sources)} "
                             f"({len(rows)} runs)",
            "families": fit_by_family(rows)}  # fmt: skip
    path = Path(out_dir) / "efficiency.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(blob, indent=2) + "\n")
    return path


def train_shipped_models(data: str | Path, out_dir: str | Path, vtrain: bool = True,
                         fleet: bool = False) -> list[Path]:  # fmt: skip
    """What ``predict train`` writes: the CPU models (precision-aware and the ablation), with
    ``vtrain`` the A100 model, with ``fleet`` the fleet-fitted efficiencies."""
    out_dir = Path(out_dir)
    paths = [train_measurement_model(data, aware).save(out_dir, "time_cpu" + ("" if aware else "_unaware"))
             for aware in (True, False)]  # fmt: skip
    if vtrain:
        paths.append(train_vtrain_model().save(out_dir, "time_a100"))
    if fleet:
        paths.append(train_fleet_efficiencies(out_dir))
    return paths
