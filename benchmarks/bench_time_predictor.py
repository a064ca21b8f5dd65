"""Time-predictor benchmark: every timing-dependent accuracy claim of the time predictor.

    .venv/bin/python benchmarks/bench_time_predictor.py                      # ~3-5 min
    .venv/bin/python benchmarks/bench_time_predictor.py --fresh-repeats 3    # + fresh CPU runs

Headline splits hold out what a user's new job changes, and every constant (the learned
correction, the per-kernel host overhead and collective latency of the roofline) is fitted
inside each fold:

U  vTrain (1,440 measured Megatron iteration times, one node of A100s, fp16-mixed), unseen
   hidden size: train on h1024 and test on h2048, and train on h2048 and test on h1024, pooled.
P  CPU measurements (this repository's ``predict collect`` data, 7 precisions), unseen
   precision: train on six precisions, predict the seventh, each in turn. Unseen sequence
   length (32 vs 128) is printed beside it. vTrain has one sequence length, one head count and
   one precision, so those splits cannot be made on it.
D  Secondary: vTrain leave one (hidden, depth) group out (its hidden size is seen at three
   other depths: interpolation).
C  Precision pairs, public: LLM Foundry's H100 bf16 vs fp8 rows (same model, batch, settings):
   mean |predicted ratio / measured ratio - 1| of t_bf16 / t_fp8, by the roofline with its
   default efficiencies, never fitted on them (the fleet-fitted efficiencies include these rows;
   their held-out pair error is F).
V  DEVELOPMENT (was validation): Megatron-LM's H100 weak-scaling table (48-6,144 GPUs; data/
   PUBLIC_SOURCES.md) is now a development fleet file, Megatron-Core's H100 efficiencies are
   fitted on it; V is its 9 rows in M's leave-one-model-out predictions. The multi-node test
   data is held out from this repository.
M  DEVELOPMENT fleet (torchtitan, LLM Foundry H100; Narayanan et al. A100 and Megatron-LM's
   H100 table; since #44 the GPU kit's 40 H200 steps of this project's own step, framework
   ``pytorch``; ``develop`` rows of predictors/data, 148 runs): leave one model out, kernel
   efficiencies fitted per device family and framework inside every fold
   (predictors/time/efficiency_fit.py).
G  DEVELOPMENT fleet, leave one GPU count out (same fitting).
X  DEVELOPMENT fleet, leave one framework out (Megatron-Core, torchtitan, LLM Foundry, this
   project's own PyTorch step): the
   held-out framework's rows are priced with their device family's efficiencies fitted on the
   other frameworks' rows (the roofline's defaults where the family has no other framework:
   Narayanan's A100 rows): how far a framework's efficiencies transfer to another.
F  DEVELOPMENT fleet bf16/fp8 pair error: the t_bf16 / t_fp8 ratio of the 23 pairs (15
   published, 8 from the H200 steps) from the leave-one-model-out predictions of both runs.
FINAL  The split frozen before any efficiency was fitted (``final`` rows: LLM Foundry H100 at
   128-512 GPUs, torchtitan H200), priced with efficiencies fitted on all development rows. It
   is scored only with ``--score-final``, once: the scoring is recorded (commit, date, figure,
   per-row errors) in ``benchmarks/final_split_scoring.json``, and a second ``--score-final``
   is refused while that record exists; every other run prints the recorded figure (or
   ``unscored``).

Per-fold and per-row figures are written to ``--out`` (JSON, one file per part, as each part
finishes) and printed. Last line: ``mape_unseen_hidden=U mape_unseen_precision=P
mape_by_depth=D precision_pair_error=C mape_fleet_new_model=M mape_fleet_new_gpus=G
mape_fleet_new_framework=X fleet_pair_error=F mape_fleet_final=FINAL
mape_multinode_validation=V``.
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


def _save(out: Path | None, name: str, blob: dict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(blob, indent=2))


def vtrain_splits(out: Path | None) -> tuple[float, float]:
    """(unseen hidden U, by depth D) on vTrain, constants fitted per fold."""
    from predictors.time.evaluate import evaluate_vtrain

    vt = evaluate_vtrain()
    u, d = vt["unseen_hidden"], vt["by_depth"]
    print(f"U vTrain unseen hidden size (both directions, pooled): MAPE {u.mape:.2f}%")
    for g, v in u.per_group.items():
        fitted = ", ".join(f"{k} {c:.0f} us" for k, c in u.constants[g].items())
        print(f"    test {g:<6} {v:6.2f}%  (fitted in fold: {fitted})")
    print(f"D vTrain by depth (secondary, interpolation): MAPE {d.mape:.2f}% (worst "
          f"{max(d.per_group, key=d.per_group.get)} {max(d.per_group.values()):.2f}%); "
          f"roofline alone, shipped constants {vt['analytical_only'].mape:.2f}%")  # fmt: skip
    _save(out, "vtrain", {k: {"mape": v.mape, "per_group": v.per_group,
                              "constants_us": v.constants} for k, v in vt.items()})  # fmt: skip
    return u.mape, d.mape


def fleet_splits(out: Path | None) -> dict[str, float]:
    """New model M, new GPU count G, new framework X, bf16/fp8 pair error F and the Megatron
    H100 rows V on the development fleet rows, efficiencies fitted inside every fold.
    DEVELOPMENT figures."""
    from predictors.time.evaluate import evaluate_fleet

    res = evaluate_fleet()
    m, g, f = res["new_model"], res["new_gpus"], res["pair_error"]
    x, mh, x0 = res["new_framework"], res["megatron_h100"], res["new_framework_defaults"]
    print(f"M DEVELOPMENT fleet, leave one model out ({len(m.rows)} runs): MAPE {m.mape:.2f}%")
    for name, v in m.per_group.items():
        print(f"    {name:<16} {v:6.2f}%")
    print(f"G DEVELOPMENT fleet, leave one GPU count out: MAPE {g.mape:.2f}% ("
          + ", ".join(f"{k} GPUs {v:.1f}%" for k, v in sorted(g.per_group.items(),
                                                              key=lambda kv: int(kv[0])))
          + ")")  # fmt: skip
    print(f"X DEVELOPMENT fleet, leave one framework out: MAPE {x.mape:.2f}% ("
          + ", ".join(f"{k} {val:.1f}%" for k, val in x.per_group.items()) + ")")
    print(f"    the held-out framework at the roofline's default efficiencies instead: MAPE "
          f"{x0.mape:.2f}% (" + ", ".join(f"{k} {val:.1f}%" for k, val in x0.per_group.items())
          + ")")
    print(f"V DEVELOPMENT (fitted on since #44) Megatron-LM H100 weak scaling ({len(mh.rows)} "
          f"runs, leave-one-model-out): MAPE {mh.mape:.2f}%")
    for name, pred, meas, err in mh.per_row():
        print(f"    {name:<16} measured {meas:7.3f} s  predicted {pred:7.3f} s  {err:+6.1f}%")
    cp = res["context_parallel"]
    print(f"  CP rows (ring attention; torchtitan 8B and 405B at CP 2-8), leave-one-model-out: "
          f"MAPE {cp.mape:.2f}% over {len(cp.rows)} runs (development)")
    for name, pred, meas, err in cp.per_row():
        print(f"    {name:<64} measured {meas:8.3f} s  predicted {pred:8.3f} s  {err:+6.1f}%")
    print(f"F DEVELOPMENT fleet bf16/fp8 pair error ({len(f.rows)} pairs, leave-one-model-out "
          f"predictions): {f.mape:.2f}%")
    for name, pred, meas, err in f.per_row():
        print(f"    {name:<72} measured x{meas:.3f}  predicted x{pred:.3f}  {err:+6.1f}%")
    _save(out, "fleet", {k: {"mape": v.mape, "per_group": v.per_group, "rows": v.per_row(),
                             "efficiencies": v.efficiencies} for k, v in res.items()})  # fmt: skip
    return {"M": m.mape, "G": g.mape, "X": x.mape, "F": f.mape, "V": mh.mape}


FINAL_RECORD = ROOT / "benchmarks" / "final_split_scoring.json"


class FinalSplitAlreadyScored(RuntimeError):
    """``--score-final`` on a checkout whose final split has been scored."""


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def refuse_second_scoring(record: Path) -> None:
    if record.exists():
        blob = json.loads(record.read_text())
        raise FinalSplitAlreadyScored(
            f"the final split was scored at commit {blob['commit'][:12]} on {blob['date']} "
            f"({record}); it is scored once")


def fleet_final(out: Path | None, score: bool, record: Path = FINAL_RECORD) -> str:
    """The frozen final split: scored once, with ``score``, and recorded; otherwise the
    recorded figure (``"unscored"`` without a record). Returns the figure for the last line."""
    if not score:
        if not record.exists():
            print("FINAL not scored (the frozen split is scored once, with --score-final)")
            return "unscored"
        blob = json.loads(record.read_text())
        print(f"FINAL recorded (scored once at commit {blob['commit'][:12]} on {blob['date']}): "
              f"MAPE {blob['mape']:.2f}%")
        return f"{blob['mape']:.2f}%"
    refuse_second_scoring(record)
    from predictors.time.evaluate import evaluate_fleet_final

    res = evaluate_fleet_final()
    print(f"FINAL (frozen before tuning, scored once) fleet rows ({len(res.rows)} runs: LLM "
          f"Foundry H100 128-512 GPUs, torchtitan H200): MAPE {res.mape:.2f}%")
    for name, pred, meas, err in res.per_row():
        print(f"    {name:<60} measured {meas:8.3f} s  predicted {pred:8.3f} s  {err:+6.1f}%")
    blob = {"commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "mape": res.mape, "per_group": res.per_group, "rows": res.per_row(),
            "efficiencies": res.efficiencies}  # fmt: skip
    record.write_text(json.dumps(blob, indent=2))
    _save(out, "fleet_final", blob)
    return f"{res.mape:.2f}%"


def precision_pairs(out: Path | None) -> float:
    from predictors.datasets.fleet import load_llm_foundry_pairs
    from predictors.time.evaluate import evaluate_precision_pairs

    res = evaluate_precision_pairs()
    notes = {p.name: p.note for p in load_llm_foundry_pairs()}
    print(f"C LLM Foundry H100 bf16/fp8 speed ratio ({len(res.rows)} pairs, roofline with "
          f"default efficiencies): mean error {res.error:.2f}%")
    for name, pred, meas, err in res.per_row():
        print(f"    {name:<16} measured x{meas:.3f}  predicted x{pred:.3f}  {err:+6.1f}%"
              f"  {notes[name]}")  # fmt: skip
    _save(out, "precision_pairs", {"error": res.error, "rows": res.per_row()})
    return res.error


def cpu_heldout(data: Path) -> dict:
    """Held-out MAPEs of the precision-aware CPU model on ``data`` (unseen precision P, unseen
    sequence length, size tier, family; the precision-unaware ablation beside them)."""
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.time.collect import device_profile_path, features_cache_path
    from predictors.time.evaluate import evaluate_measurements

    df = load_measurements(data)
    device = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    res = evaluate_measurements(df, device, cache=features_cache_path(data))
    prec = res["by_precision"]
    print(f"    {len(df)} rows: unseen precision {prec.mape:.2f}% ("
          + ", ".join(f"{k} {v:.1f}%" for k, v in prec.per_group.items())
          + f"); unseen seq {res['by_seq'].mape:.2f}% ("
          + ", ".join(f"{k} {v:.1f}%" for k, v in res["by_seq"].per_group.items())
          + f"); by size tier {res['by_size'].mape:.2f}% (unaware "
          f"{res['by_size_unaware'].mape:.2f}%), by family {res['by_family'].mape:.2f}% "
          f"(unaware {res['by_family_unaware'].mape:.2f}%)")  # fmt: skip
    return {k: {"mape": v.mape, "per_group": v.per_group} for k, v in res.items()}


def fresh_cpu(repeats: int, rounds: int) -> list[float]:
    from predictors.time.collect import collect_interleaved, default_grid

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
            out.append(cpu_heldout(data)["by_precision"]["mape"])
    return out


def latency() -> None:
    from predictors import predict_iteration_time
    from predictors.spec import ParallelStrategy, TransformerSpec
    from predictors.time.predictor import _predict

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
    ap.add_argument("--fresh-repeats", type=int, default=0,
                    help="independent fresh CPU collections (~3 min each on 2 quiet cores) "
                         "scored by unseen precision beside the shipped measurements")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per collection")
    ap.add_argument("--score-final", action="store_true",
                    help="score the frozen final split, once: recorded in "
                         "benchmarks/final_split_scoring.json; refused when already recorded")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_time",
                    help="directory for per-part JSON results (written as each part ends)")
    args = ap.parse_args()
    if args.score_final:  # refuse before minutes of other work
        try:
            refuse_second_scoring(FINAL_RECORD)
        except FinalSplitAlreadyScored as exc:
            print(f"error: --score-final: {exc}", file=sys.stderr)
            return 2

    from predictors.datasets import data_path

    t0 = time.time()
    u, d = vtrain_splits(args.out)
    print("P CPU measurements (shipped), unseen precision:")
    cpu = cpu_heldout(data_path("cpu_measurements.csv"))
    _save(args.out, "cpu_shipped", cpu)
    p = cpu["by_precision"]["mape"]
    fresh = fresh_cpu(args.fresh_repeats, args.rounds) if args.fresh_repeats else []
    if fresh:
        print(f"  P on fresh collections x{len(fresh)}: median {statistics.median(fresh):.2f}% "
              f"(min {min(fresh):.2f}% max {max(fresh):.2f}%)")
        _save(args.out, "cpu_fresh", {"unseen_precision": fresh})
    c = precision_pairs(args.out)
    fl = fleet_splits(args.out)
    final = fleet_final(args.out, args.score_final)
    latency()
    print(f"  total {time.time() - t0:.0f} s")
    print(f"mape_unseen_hidden={u:.2f}% mape_unseen_precision={p:.2f}% mape_by_depth={d:.2f}% "
          f"precision_pair_error={c:.2f}% mape_fleet_new_model={fl['M']:.2f}% "
          f"mape_fleet_new_gpus={fl['G']:.2f}% mape_fleet_new_framework={fl['X']:.2f}% "
          f"fleet_pair_error={fl['F']:.2f}% mape_fleet_final={final} "
          f"mape_multinode_validation={fl['V']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
