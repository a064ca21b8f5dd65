"""``predict``: time / collect / train / eval (time predictor) + the memory predictor's commands.

    predict time --model gpt --layers 24 --hidden 2048 --heads 16 --seq 2048 \\
        --strategy dp4tp2pp1mb2gb64 --precision bf16 --device a100-80gb
    predict collect --out out/measurements.csv --minutes 18
    predict train --data out/measurements.csv --out-dir out/models
    predict eval --data out/measurements.csv --out out/
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from predictors.cli_parser import EXIT_ERROR, PredictArgumentParser
from predictors.flag_values import flag_type, parse_count, parse_counts, parse_positive


def _shipped_measurements() -> Path:
    from importlib import resources

    return Path(str(resources.files("predictors") / "data" / "cpu_measurements.csv"))


# the families ``predict time`` builds from --layers/--hidden/...: (SwiGLU MLP, tied embeddings)
TIME_FAMILIES = {"gpt": (False, True), "bert": (False, True), "llama": (True, False)}
# `predict time`'s size flags and a family's defaults (None: the spec's own, from the others)
FAMILY_SIZES = {"--layers": 24, "--hidden": 2048, "--heads": 16, "--kv-heads": None,
                "--ffn": None, "--vocab": 50257}


def _add_time(sub) -> None:
    p = sub.add_parser("time", help="predict the time of one training iteration")
    p.add_argument("--model", default="gpt",
                   help=f"{' | '.join(TIME_FAMILIES)}, or a zoo name (gpt-s, ...)")
    # the sizes of a family's model (None: not given; the family's default then); a zoo name
    # fixes its own, so a size given with one is refused (it was ignored without a word)
    for flag, default in FAMILY_SIZES.items():
        p.add_argument(flag, type=int, default=None,
                       help=f"a family's size (default {default or 'from the others'}; not with a "
                            "zoo name)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--strategy", default="dp1tp1pp1mb1", help="dp<D>tp<T>pp<P>[mb<M>][gb<G>]")
    p.add_argument("--precision", default="bf16", help="a precision name, or 'all' for a table")
    p.add_argument("--device", default="a100-80gb", help="a100-80gb, h100-80gb, ..., cpu, local")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=cmd_time)


def cmd_time(args) -> int:
    from predictors.devices import UnsupportedPrecisionError, get_device
    from predictors.spec import ParallelStrategy, TransformerSpec
    from predictors.spec.model import ModelSpecError, UnknownModelError
    from predictors.spec.precision import PRECISIONS
    from predictors.time.collect import model_zoo
    from predictors.time.predictor import predict

    zoo = model_zoo(args.seq)
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in FAMILY_SIZES}
    if args.model in zoo:
        if named := [flag for flag, value in given.items() if value is not None]:
            raise ModelSpecError(f"{', '.join(named)}: the zoo model {args.model!r} fixes its "
                                 f"own size; set sizes with a family ({', '.join(TIME_FAMILIES)})")
        spec = zoo[args.model]
    elif args.model in TIME_FAMILIES:
        swiglu, tied = TIME_FAMILIES[args.model]
        size = {flag: default if given[flag] is None else given[flag]
                for flag, default in FAMILY_SIZES.items()}
        spec = TransformerSpec(args.model, size["--layers"], size["--hidden"], size["--heads"],
                               args.seq, size["--vocab"], ffn_hidden_size=size["--ffn"],
                               num_query_groups=size["--kv-heads"], swiglu=swiglu,
                               tied_embeddings=tied)  # fmt: skip
    else:
        raise UnknownModelError(f"--model {args.model!r} is unknown; choose a family "
                                f"({', '.join(TIME_FAMILIES)}) or a zoo name "
                                f"({', '.join(zoo)})")
    strategy = ParallelStrategy.parse(args.strategy)
    device = get_device(args.device)
    names = list(PRECISIONS) if args.precision == "all" else [args.precision]
    results = {}
    for name in names:
        try:
            res = predict(spec, strategy, name, device)
        except UnsupportedPrecisionError as exc:
            if len(names) == 1:
                raise
            print(f"  {name:<11} skipped: {exc}")
            continue
        results[name] = {"seconds": res.seconds, "analytical_seconds": res.analytical_seconds,
                         "calibrated": res.calibrated, "model_file": res.model_file,
                         "fitted_efficiency": res.fitted_efficiency,
                         "breakdown": res.breakdown.as_dict()}  # fmt: skip
    out = {"model": spec.family, "strategy": strategy.name, "device": device.name,
           "predictions": results}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    fastest = min(r["seconds"] for r in results.values())
    print(f"{spec.family} {strategy.name} on {device.name}:")
    for name, r in results.items():
        note = ("" if r["calibrated"] else "  (roofline with fleet-fitted efficiencies)"
                if r["fitted_efficiency"] else "  (analytical only: no trained model for this device)")
        print(
            f"  {name:<11} {r['seconds'] * 1e3:10.2f} ms/iteration  "
            f"x{r['seconds'] / fastest:5.2f} of fastest{note}"
        )
    if len(results) == 1:
        for k, v in next(iter(results.values()))["breakdown"].items():
            if k.endswith("_bytes"):
                print(f"    network    {k:<14} {v / 1e9:10.3f} GB per rank per iteration")
            elif k.endswith("nodes"):
                print(f"    network    {k:<14} {int(v):10d}")
            else:
                print(f"    analytical {k:<14} {v * 1e3:10.3f} ms")
    return 0


def _add_collect(sub) -> None:
    p = sub.add_parser("collect", help="measure iteration times on this machine (resumable)")
    p.add_argument("--out", default="out/measurements.csv")
    p.add_argument("--minutes", type=flag_type(parse_positive), default=20.0,
                   help="time budget; rerun to resume")
    p.add_argument("--precisions", default=None, help="comma list (default: all the device runs)")
    p.add_argument("--models", default=None, help="comma list of zoo names (default: all)")
    # each value >= 1 and each once: a 0 batch or DP size reached the measurement, and a repeat
    # put its points in the grid twice (measured twice per pass, two rows each)
    p.add_argument("--seqs", type=flag_type(parse_counts), default="32,128",
                   help="sequence lengths, comma list")
    p.add_argument("--batches", type=flag_type(parse_counts), default="1,4",
                   help="micro-batch sizes, comma list")
    p.add_argument("--dp", type=flag_type(parse_counts), default="1,2",
                   help="data-parallel sizes (gloo processes), comma list")
    # each >= 1: 0 or fewer repeats crashed (IndexError) after the first point's warm-up steps,
    # 0 or fewer threads crashed in torch, and 0 or fewer passes measured nothing and exited 0
    p.add_argument("--repeats", type=flag_type(parse_count), default=5)
    p.add_argument("--threads", type=flag_type(parse_count), default=1)
    p.add_argument(
        "--passes",
        type=flag_type(parse_count),
        default=1,
        help="measure each point this many times in separate passes (keep fastest)",
    )
    p.set_defaults(func=cmd_collect)


def cmd_collect(args) -> int:
    from predictors.spec.model import UnknownModelError
    from predictors.spec.precision import cpu_precisions, get_precision
    from predictors.time.collect import collect, default_grid, unknown_models

    precisions = args.precisions.split(",") if args.precisions else cpu_precisions()
    for name in precisions:
        get_precision(name)  # named error before any measurement
    models = None
    if args.models:
        models = [name.strip() for name in args.models.split(",") if name.strip()]
        if why := unknown_models(models, args.seqs[0]):  # in the flag's words
            raise UnknownModelError(f"--models {args.models!r}: {why}")
    points = default_grid(precisions, args.seqs, args.batches, models, args.dp)
    out = collect(args.out, points, repeats=args.repeats, max_minutes=args.minutes,
                  threads=args.threads, passes=args.passes)  # fmt: skip
    print(f"measurements in {out}")
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train the LightGBM correction (CPU data and/or vTrain)")
    p.add_argument("--data", default=None, help="measurements CSV (default: shipped CPU data)")
    p.add_argument("--vtrain", action="store_true", help="also train the A100 model on vTrain")
    p.add_argument("--fleet", action="store_true",
                   help="also fit the per-family efficiencies on the development fleet rows")
    p.add_argument("--out-dir", default="out/models")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    out_dir = Path(args.out_dir)
    data = Path(args.data) if args.data else _shipped_measurements()
    from predictors.time.train import train_shipped_models

    for path in train_shipped_models(data, out_dir, vtrain=args.vtrain, fleet=args.fleet):
        print(f"wrote {path}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out MAPE (by family, by size), precision ablation")
    p.add_argument("--data", default=None, help="measurements CSV (default: shipped CPU data)")
    p.add_argument("--out", default="out", help="directory for plots and eval.json")
    p.add_argument("--no-vtrain", action="store_true")
    p.set_defaults(func=cmd_eval)


def run_eval(data: Path, out: Path, vtrain: bool = True) -> dict[str, float]:
    from predictors.datasets.measurements import load_measurements
    from predictors.devices import Device
    from predictors.time.collect import device_profile_path, features_cache_path
    from predictors.time.evaluate import (
        evaluate_measurements,
        evaluate_vtrain,
        scatter_by_precision,
    )

    df = load_measurements(data)
    device = Device.from_dict(json.loads(device_profile_path(data).read_text()))
    res = evaluate_measurements(df, device, cache=features_cache_path(data))
    summary = {k: v.mape for k, v in res.items()}
    for key in ("by_precision", "by_family", "by_size", "by_family_unaware", "by_size_unaware"):
        scatter_by_precision(res[key], df["precision"], out, f"CPU held out {key}")
    if vtrain:
        vt = evaluate_vtrain()
        summary.update({f"vtrain_{k}": v.mape for k, v in vt.items()})
        for key in ("unseen_hidden", "by_depth"):
            scatter_by_precision(vt[key], ["fp16-mixed"] * len(vt[key].measured), out,
                                 f"vTrain A100 {key}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_time.json").write_text(json.dumps(summary, indent=2))
    return summary


def cmd_eval(args) -> int:
    data = Path(args.data) if args.data else _shipped_measurements()
    summary = run_eval(data, Path(args.out), vtrain=not args.no_vtrain)
    for k, v in summary.items():
        print(f"{k:<28} MAPE {v:7.2f}%")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = PredictArgumentParser(prog="predict", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_time, _add_collect, _add_train, _add_eval):
        add(sub)
    if importlib.util.find_spec("predictors.memory.cli") is not None:
        from predictors.memory.cli import add_subcommands

        add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "module", None) and "" not in sys.path and os.getcwd() not in sys.path:
        # `--module mypkg.models:build` names the user's code: resolve it from the working
        # directory, as `python -m` would (a console script does not put it on the path)
        sys.path.insert(0, os.getcwd())
    from predictors.devices import UnknownDeviceError, UnsupportedPrecisionError
    from predictors.spec import ModelSpecError, StrategyError
    from predictors.spec.precision import UnknownPrecisionError

    try:
        return int(args.func(args) or 0)
    except (UnknownPrecisionError, UnknownDeviceError, UnsupportedPrecisionError,
            StrategyError, ModelSpecError) as exc:  # fmt: skip
        print(f"predict {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
