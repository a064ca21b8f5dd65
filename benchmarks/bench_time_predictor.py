"""Time-predictor benchmark: load (or collect) measurements, train, evaluate held out.

    .venv/bin/python benchmarks/bench_time_predictor.py            # shipped CPU measurements
    .venv/bin/python benchmarks/bench_time_predictor.py --collect  # re-measure (~12 min)

CPU rows are held out by model family AND by model size (never a random row split); the
reported X is the mean of the two. Y is the same evaluation with the step traced at fp32 and
every precision feature removed (the paper's ablation). Z is vTrain (A100, Megatron), held out
by model size. Also reported: per-call latency of predict_iteration_time after warm-up.
Last line: ``mape_heldout=X% mape_precision_unaware=Y% mape_vtrain_heldout=Z%``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", action="store_true", help="measure afresh into benchmarks/.cache")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_time_predictor"))
    args = ap.parse_args()

    from predictors.collect import (
        collect,
        default_grid,
        device_profile_path,
        features_cache_path,
        load_measurements,
    )
    from predictors.devices import Device
    from predictors.evaluate import evaluate_measurements, evaluate_vtrain, scatter_by_precision
    from predictors.vtrain import data_path

    if args.collect:
        data = CACHE / "measurements.csv"
        collect(data, default_grid(), max_minutes=args.minutes)
    else:
        data = data_path("cpu_measurements.csv")
    df = load_measurements(data)
    device = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    print(
        f"{len(df)} CPU measurements from {data} ({df['family'].nunique()} families, "
        f"{df['model'].nunique()} sizes, {df['precision'].nunique()} precisions)"
    )
    t0 = time.time()
    res = evaluate_measurements(df, device, cache=features_cache_path(data))
    for key, r in res.items():
        print(
            f"  cpu {key:<20} MAPE {r.mape:6.2f}%  worst group "
            f"{max(r.per_group, key=r.per_group.get)} {max(r.per_group.values()):.1f}%"
        )
        scatter_by_precision(r, df["precision"], args.out, f"CPU held out {key}")
    vt = evaluate_vtrain()
    for key, r in vt.items():
        print(f"  vtrain {key:<17} MAPE {r.mape:6.2f}%")
    print(f"  evaluation took {time.time() - t0:.0f} s")

    from predictors import predict_iteration_time
    from predictors.spec import ParallelStrategy, TransformerSpec

    spec = TransformerSpec("gpt", 24, 2048, 16, 2048, 50257)
    strategies = [ParallelStrategy(8 // (tp * pp), tp, pp, mb, 64)
                  for tp in (1, 2, 4) for pp in (1, 2) for mb in (1, 2, 4)]  # fmt: skip
    for s in strategies:  # warm-up: traces each (tp, micro-batch) shape once
        predict_iteration_time(spec, s, "bf16", "a100-80gb")
    from predictors.time_predictor import _predict

    _predict.cache_clear()  # time the full path (features + model), not the result cache
    lat = []
    for s in strategies:
        t = time.perf_counter()
        predict_iteration_time(spec, s, "bf16", "a100-80gb")
        lat.append(time.perf_counter() - t)
    print(
        f"  predict_iteration_time after warm-up: median {statistics.median(lat) * 1e3:.2f} ms, "
        f"max {max(lat) * 1e3:.2f} ms per call (goal < 10 ms)"
    )

    x = (res["by_family"].mape + res["by_size"].mape) / 2
    y = (res["by_family_unaware"].mape + res["by_size_unaware"].mape) / 2
    z = vt["by_size"].mape
    print(f"mape_heldout={x:.2f}% mape_precision_unaware={y:.2f}% mape_vtrain_heldout={z:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
