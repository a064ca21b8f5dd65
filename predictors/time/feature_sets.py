"""Feature rows of the data sets the corrections are trained and evaluated on: vTrain's rows
and ``predict collect``'s CPU measurements (with a feature cache keyed by the code that
computes them). The trainers (:mod:`predictors.time.train`), the held-out evaluation
(:mod:`predictors.time.evaluate`) and CONA build their rows here."""

from __future__ import annotations

from pathlib import Path


def vtrain_features(precision_aware: bool = True, rows=None, device=None):
    """(rows, feature rows) of vTrain; ``device`` defaults to the table's ``a100-80gb`` (pass
    one with fitted constants, :func:`predictors.time.calibrate.with_constants`)."""
    from predictors.datasets.vtrain import VTRAIN_DEVICE, VTRAIN_PRECISION, load_vtrain
    from predictors.devices import get_device
    from predictors.time.features import features

    rows = rows if rows is not None else load_vtrain()
    dev = device or get_device(VTRAIN_DEVICE)
    feats = [features(r.spec, r.strategy, VTRAIN_PRECISION, dev,
                      precision_aware=precision_aware) for r in rows]  # fmt: skip
    return rows, feats


def feature_code_version() -> str:
    """Version of the code that turns a configuration into features (invalidates caches): every
    module :mod:`predictors.time.features` can import. The profile's numbers and the fitted
    per-kernel cost are part of the cache tag and row key."""
    from predictors.codegraph import code_version

    return code_version("predictors.time.features")


def features_cache_tag(device) -> str:
    """What a features cache was computed with: the feature code's version, the device and its
    peaks; rows under another tag are recomputed."""
    import json

    return f"{feature_code_version()}|{device.name}|{json.dumps(device.peak_flops, sort_keys=True)}"


def measurement_features(df, precision_aware: bool, device, cache: str | Path | None = None
                         ) -> list[dict]:  # fmt: skip
    """Features of measured rows against the CPU profile they were measured with.

    ``cache`` (a JSON file) keeps feature rows keyed by configuration, code version and
    device, so re-evaluating a data set does not re-trace every model.
    """
    import json

    from predictors.datasets.measurements import KEY_COLUMNS
    from predictors.time.collect import row_spec_strategy
    from predictors.time.features import features

    cache = Path(cache) if cache else None
    tag = features_cache_tag(device)
    stored = {}
    if cache and cache.exists():
        blob = json.loads(cache.read_text())
        stored = blob.get("rows", {}) if blob.get("tag") == tag else {}
    out, dirty = [], False
    for _, r in df.iterrows():
        key = "|".join(str(r[k]) for k in KEY_COLUMNS) + f"|aware={precision_aware}"
        key += f"|overhead={device.launch_overhead:.6g}"
        if key not in stored:
            spec, strategy = row_spec_strategy(r)
            stored[key] = features(spec, strategy, r["precision"], device,
                                   precision_aware=precision_aware)  # fmt: skip
            dirty = True
        out.append(stored[key])
    if cache and dirty:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"tag": tag, "rows": stored}))
    return out


