"""Time-predictor benchmark: every timing-dependent accuracy claim of the time predictor.

    .venv/bin/python benchmarks/bench_time_predictor.py
    .venv/bin/python benchmarks/bench_time_predictor.py --fresh-repeats 0   # no CPU measuring

A  vTrain (1,440 measured Megatron iteration times, one node of A100s), held out by model size
   (hidden x depth): train on 7 sizes, predict the 8th, every size in turn.
B  Multi-node, public: Megatron-LM's H100 weak-scaling table (48-6,144 GPUs; data/
   PUBLIC_SOURCES.md), scored against the shipped predictor as a user calls it. Never trained
   on. vTrain's multi-node file is held out and not used at all.
C  Precision pairs, public: LLM Foundry's H100 bf16 vs fp8 rows (same model, batch, settings):
   mean |predicted ratio / measured ratio - 1| of t_bf16 / t_fp8.
D  CPU, held out by size tier across all families (``xs``/``s``/``m`` of every family at once),
   on measurements taken now (interleaved rounds, ``--fresh-repeats`` independent collections,
   median and spread reported); the same on the shipped measurements is printed for reference.

Last line: ``mape_vtrain_single_by_size=A mape_multinode_public=B precision_pair_error=C
mape_cpu_heldout=D`` (D the median over repeats; its range follows on the same line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRESH_MODELS = [f"{f}-{s}" for f in ("gpt", "llama", "bert", "vit", "convnet") for s in ("s", "m")]
FRESH_PRECISIONS = ("fp32", "bf16", "bf16-pure", "bf16-mixed", "fp16-mixed", "fp16-pure")


def vtrain_by_size() -> float:
    from predictors.evaluate import evaluate_vtrain

    vt = evaluate_vtrain()
    by = vt["by_size"]
    print(f"A vTrain held out by size: MAPE {by.mape:.2f}% (worst size "
          f"{max(by.per_group, key=by.per_group.get)} {max(by.per_group.values()):.2f}%); "
          f"train h1024 -> test h2048 {vt['small_to_large'].mape:.2f}%; "
          f"roofline alone {vt['analytical_only'].mape:.2f}%")  # fmt: skip
    return by.mape


def multinode_public() -> float:
    from predictors.model import TimeModel, shipped_model_path
    from predictors.public import evaluate_multinode
    from predictors.time_predictor import predict_with_model

    res = evaluate_multinode()
    a100 = TimeModel.load(shipped_model_path("a100"))
    borrowed = evaluate_multinode(lambda r: predict_with_model(
        a100, r.spec, r.strategy, r.precision, r.device, options=r.options))  # fmt: skip
    print(f"B Megatron-LM H100 weak scaling ({len(res.rows)} runs, 48-6,144 GPUs): "
          f"MAPE {res.error:.2f}% (with the A100 correction borrowed: {borrowed.error:.2f}%)")
    for name, pred, meas, err in res.per_row():
        print(f"    {name:<16} measured {meas:7.3f} s  predicted {pred:7.3f} s  {err:+6.1f}%")
    return res.error


def precision_pairs() -> float:
    from predictors.public import evaluate_precision_pairs, load_llm_foundry_pairs

    res = evaluate_precision_pairs()
    notes = {p.name: p.note for p in load_llm_foundry_pairs()}
    print(f"C LLM Foundry H100 bf16/fp8 speed ratio ({len(res.rows)} pairs): "
          f"mean error {res.error:.2f}%")
    for name, pred, meas, err in res.per_row():
        print(f"    {name:<16} measured x{meas:.3f}  predicted x{pred:.3f}  {err:+6.1f}%"
              f"  {notes[name]}")  # fmt: skip
    return res.error


def cpu_heldout(data: Path) -> tuple[float, float]:
    """(by size tier, by family) held-out MAPE of the precision-aware CPU model on ``data``."""
    from predictors.collect import device_profile_path, features_cache_path, load_measurements
    from predictors.devices import Device
    from predictors.evaluate import evaluate_measurements

    df = load_measurements(data)
    device = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    res = evaluate_measurements(df, device, cache=features_cache_path(data))
    print(f"    {len(df)} rows: by size tier {res['by_size'].mape:.2f}% "
          f"(unaware {res['by_size_unaware'].mape:.2f}%), by family {res['by_family'].mape:.2f}% "
          f"(unaware {res['by_family_unaware'].mape:.2f}%); per tier "
          + ", ".join(f"{k} {v:.1f}%" for k, v in res["by_size"].per_group.items()))  # fmt: skip
    return res["by_size"].mape, res["by_family"].mape


def fresh_cpu(repeats: int, rounds: int) -> list[float]:
    from predictors.collect import collect_interleaved, default_grid

    points = default_grid(FRESH_PRECISIONS, seqs=(32,), batches=(1, 4), models=FRESH_MODELS,
                          dp_sizes=(1,))  # fmt: skip
    out = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            data = collect_interleaved(Path(tmp) / "fresh.csv", points, rounds=rounds,
                                       progress=False)  # fmt: skip
            print(f"  D repeat {i + 1}/{repeats}: {len(points)} points measured in "
                  f"{time.time() - t0:.0f} s")
            out.append(cpu_heldout(data)[0])
    return out


def latency() -> None:
    from predictors import predict_iteration_time
    from predictors.spec import ParallelStrategy, TransformerSpec
    from predictors.time_predictor import _predict

    spec = TransformerSpec("gpt", 24, 2048, 16, 2048, 50257)
    strategies = [ParallelStrategy(8 // (tp * pp), tp, pp, mb, 64)
                  for tp in (1, 2, 4) for pp in (1, 2) for mb in (1, 2, 4)]  # fmt: skip
    for s in strategies:  # warm-up: traces each (tp, micro-batch) shape once
        predict_iteration_time(spec, s, "bf16", "a100-80gb")
    _predict.cache_clear()  # time the full path (features + model), not the result cache
    lat = []
    for s in strategies:
        t = time.perf_counter()
        predict_iteration_time(spec, s, "bf16", "a100-80gb")
        lat.append(time.perf_counter() - t)
    print(f"  predict_iteration_time after warm-up: median {statistics.median(lat) * 1e3:.2f} ms,"
          f" max {max(lat) * 1e3:.2f} ms per call (goal < 10 ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh-repeats", type=int, default=3,
                    help="independent fresh CPU collections for D (0: shipped data only)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per collection")
    args = ap.parse_args()

    from predictors.vtrain import data_path

    a = vtrain_by_size()
    b = multinode_public()
    c = precision_pairs()
    print("D CPU held out by size tier, shipped measurements:")
    shipped, _ = cpu_heldout(data_path("cpu_measurements.csv"))
    fresh = fresh_cpu(args.fresh_repeats, args.rounds) if args.fresh_repeats else []
    latency()
    if fresh:
        d = statistics.median(fresh)
        spread = (f"(fresh x{len(fresh)}: min {min(fresh):.2f}% max {max(fresh):.2f}%; "
                  f"shipped {shipped:.2f}%)")  # fmt: skip
    else:
        d, spread = shipped, "(shipped measurements only)"
    print(f"mape_vtrain_single_by_size={a:.2f}% mape_multinode_public={b:.2f}% "
          f"precision_pair_error={c:.2f}% mape_cpu_heldout={d:.2f}% {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
