"""``cona``: plan candidate strategies, train with CONA, evaluate time-to-perplexity, plot.

    cona plan --world 8 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
              --seq-length 1024 --global-batch-range 16,128 --device a100-80gb
    torchrun --nproc-per-node 8 -m megatron_cona.cli run <Megatron-LM flags> --cona ...
    python scripts/cona_cpu.py ttp -- --out out   # TTP on real curves (repository launcher)
    cona scale --switch-costs 0.5,0.01 --out out/cona_scale   # law-based simulation at scale
    cona plot --log cona.jsonl --out out/cona_timeline.png

Errors print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from predictors.spec import TransformerSpec

CPU_HINT = ("no GPU here: megatron-core's CUDA calls must be redirected on CPU, run "
            "`python scripts/cona_cpu.py {cmd}` from the repository instead")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _int_pair(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.replace(":", ",").split(",")]
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX with 1 <= MIN <= MAX")
    return parts[0], parts[1]


def _float_list(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# ------------------------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from megatron_cona.candidates import CandidateSpec, enumerate_candidates, parse_candidate_list
    from megatron_cona.goodput import PredictorThroughput, estimate

    model = TransformerSpec("gpt", args.num_layers, args.hidden_size, args.num_attention_heads,
                            args.seq_length, args.vocab_size)
    user = parse_candidate_list(args.candidates)
    spec = CandidateSpec(layouts=user.layouts, fixed=user.fixed,
                         micro_batches=args.micro_batches,
                         global_batch_range=args.global_batch_range)
    cands = enumerate_candidates(args.world, model, spec)
    times = PredictorThroughput(model, args.precision, args.device)
    rows = sorted((estimate(s, times.iteration_time(s), args.noise_scale, args.base_batch,
                            "predicted") for s in cands.kept), key=lambda e: -e.goodput)
    ranking = (f"goodput with noise scale {args.noise_scale:g}" if math.isfinite(args.noise_scale)
               else "ranked by throughput (no --noise-scale given: statistical efficiency 1)")
    table = Table(title=f"{len(cands.kept)} candidates on {args.world}x {args.device} "
                  f"({args.precision}); {ranking}")
    for col in ("strategy", "iter time (ms)", "samples/s", "efficiency", "goodput"):
        table.add_column(col, justify="right")
    for e in rows[: args.top]:
        table.add_row(e.strategy.name, f"{1e3 * e.iteration_time:.1f}", f"{e.throughput:.1f}",
                      f"{e.efficiency:.3f}", f"{e.goodput:.1f}")
    console = Console()
    console.print(table)
    for rej in cands.rejected:
        console.print(f"dropped {rej.strategy.name}: {rej.reason}")


# -------------------------------------------------------------------------------------- ttp


def _ttp_parser() -> argparse.ArgumentParser:
    from megatron_cona.ttp import TTPOptions

    d = TTPOptions()
    p = argparse.ArgumentParser(prog="cona ttp", description="Time-to-perplexity on cached real "
                                "training curves and a SIMULATED clock: every registered "
                                "baseline, CONA and the DP bound.")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--cache", type=Path, default=d.cache, help="curve cache directory")
    p.add_argument("--families", type=_str_list, default=d.families,
                   help="small models that really train: gpt, llama (comma-separated)")
    p.add_argument("--seeds", type=_int_list, default=d.seeds)
    p.add_argument("--variants", type=_str_list, default=d.variants,
                   help="LR variants: sqrt (one tuned base LR, sqrt-scaled), table (per batch)")
    p.add_argument("--batches", type=_int_list, default=d.batches)
    p.add_argument("--user-global-batch", type=int, default=d.user_global_batch)
    p.add_argument("--budget-samples", type=int, default=d.budget_samples,
                   help="length of the offline planner's run; its final loss is the target")
    p.add_argument("--interval-samples", type=int, default=d.interval_samples)
    p.add_argument("--lr-grid", type=_float_list, default=d.lr_grid)
    p.add_argument("--lr-multipliers", type=_float_list, default=d.lr_multipliers)
    p.add_argument("--rampup-starts", type=_int_list, default=d.rampup_starts)
    p.add_argument("--rampup-fractions", type=_float_list, default=d.rampup_fractions)
    p.add_argument("--workers", type=int, default=d.workers,
                   help="1-rank processes training curves at a time")
    p.add_argument("--min-gain", type=float, default=d.min_gain)
    p.add_argument("--noise-z", type=float, default=d.noise_z)
    p.add_argument("--fresh", action="store_true", help="re-train every curve")
    p.add_argument("--no-check-exact", dest="check_exact", action="store_false",
                   help="skip re-training one cached curve bit-exactly")
    p.add_argument("--skip", type=_str_list, default=(), help="chains to leave out")
    return p


def ttp_options(argv: list[str]):
    from megatron_cona.ttp import TTPOptions

    return TTPOptions(**vars(_ttp_parser().parse_args(argv)))


def print_ttp(report: dict) -> None:
    """Every case's chains (registry order), the per-variant summaries, and last the result
    line of the ``table`` variant (the ``sqrt`` one just above it)."""
    from megatron_cona.ttp import BASELINES, result_line

    clock, pred, curves = report["clock"], report["predictor"], report["curves"]
    print(f"NOTE: {report['note']}")
    print(f"clock: layout-switch fixed cost {clock['fixed_layout_switch_s']:.3f} s, batch switch "
          f"{clock['batch_switch_s']:.4f} s (measured here), link "
          f"{clock['link_bytes_per_s'] / 1e9:.0f} GB/s")
    print(f"CONA's predictor: {pred['train_rows']} vTrain rows without group "
          f"{pred['held_out_group']}; MAPE on the charged rows {pred['held_out_mape_pct']:.2f}%")
    print(f"curves: {curves['loaded']} loaded from {curves['cache']}, {curves['trained']} "
          f"trained; code {curves['code']}; bit-exact re-train: {curves['bit_exact_check']}")
    for fam, info in report["families"].items():
        table = ", ".join(f"{b}: {lr:.2e}" for b, lr in sorted(info["lr_table"].items(),
                                                               key=lambda kv: int(kv[0])))
        print(f"{fam}: base LR {info['base_lr']:.2e}; LR table {{{table}}}")
    for case in report["cases"]:
        print(f"{case['tag']}: target ppl {case['target_ppl']:.3f} (planner "
              f"{case['planner_strategy']}, LR rule {case['lr_rule']})")
        for name in [n for n in BASELINES if n in case["runs"]]:
            run = case["runs"][name]
            chain = " -> ".join(dict.fromkeys(p["strategy"] for p in run["points"]))
            print(f"  {name:8s} TTP {run['ttp_s']:9.2f} s  switches {len(run['switches']):2d}  "
                  f"{chain[:110]}")
    for variant, metrics in report["summary"].items():
        for name, m in metrics.items():
            print(f"[{variant}] {name}: median {m['median']:.3f} (min {m['min']:.3f}, max "
                  f"{m['max']:.3f}) over {len(m['values'])} cases")
    print(f"wall {report['wall_s']:.0f} s")
    ordered = sorted(report["summary"], key=lambda v: v == "table")
    for variant in ordered[:-1]:
        print(f"[{variant}] {result_line(report['summary'], variant)}")
    print(result_line(report["summary"], ordered[-1]))


def _ttp(rest: list[str]) -> None:
    ttp_options(rest)  # parses first, so --help works everywhere
    raise CliError("cona ttp trains its curves on CPU ranks through the repository's launcher "
                   "(megatron_cpu, not installed with the plugin): run `python "
                   f"scripts/cona_cpu.py ttp -- {' '.join(rest)}` from the repository")


# ------------------------------------------------------------------------------------ scale


def _switch_costs(text: str) -> tuple[float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 2 or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIXED,BATCH seconds >= 0")
    return parts[0], parts[1]


def scale_parser() -> argparse.ArgumentParser:
    from megatron_cona.lawsim.evaluate import SimOptions

    d = SimOptions()
    p = argparse.ArgumentParser(prog="cona scale", description="CONA at the paper's scale: a "
                                "SIMULATED training law (Kaplan 2020, McCandlish 2018) driving "
                                "the real controller, every rival and a lower bound.")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--families", type=_str_list, default=d.families)
    p.add_argument("--gpus", type=_int_list, default=d.gpus)
    p.add_argument("--variants", type=_str_list, default=d.variants,
                   help=f"law variants: {', '.join(d.variants)}")
    p.add_argument("--micro-batches", type=_int_list, default=d.micro_batches)
    p.add_argument("--pipeline", type=_int_list, default=d.pipeline)
    p.add_argument("--min-gain", type=float, default=d.min_gain)
    p.add_argument("--noise-z", type=float, default=d.noise_z)
    p.add_argument("--first-interval-iterations", type=int, default=d.first_interval_iterations,
                   help="the first decision after this many iterations at the paper's batch")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--exact-bound", action="store_true",
                   help="the exact DP with the chains' cadence and switch costs beside the "
                        "relaxation (~3.5 min per 512-GPU case on 2 cores)")
    p.add_argument("--bound-snap", type=float, default=d.bound_snap,
                   help="the exact DP's S grid (relative step; rounded up: still a bound)")
    p.add_argument("--skip", type=_str_list, default=(), help="chains to leave out")
    return p


def print_scale(report: dict, law_r2: float = math.nan) -> None:
    """Per law variant and GPU count the worst cases, then one line each (medians); the main
    law (Kaplan's) last, its largest scale the very last line. Whatever did not run says why."""
    from megatron_cona.lawsim.evaluate import result_line, worst_line

    checks = report["checks_line"]
    summaries = report["summary"]
    order = [v for v in summaries if v != "kaplan"] + (["kaplan"] if "kaplan" in summaries
                                                       else [])
    for variant in order:
        for gpus in summaries[variant]:
            print(worst_line(summaries[variant], gpus, variant))
    if not report["options"].get("exact_bound") == "True":
        print("gap_to_exact_bound=not_run: the exact DP takes minutes per case at these "
              "scales; run with --exact-bound (gap_to_relaxed_bound is against a bound that "
              "ignores switch costs and cadence, so it can only overstate the gap)")
    if not any("pollux" in c["chains"] for c in report["cases"]):
        print("speedup_vs_pollux=not_run: Pollux runs adaptdl's own goodput code, which is not "
              "installed with the plugin (benchmarks/bench_cona_scale.py in `make bench-env`'s "
              "venv runs it)")
    if not math.isfinite(law_r2):
        print("law_r2=not_run: the law check on the real Megatron-Core loop (issue 42 item 5) "
              "is not implemented yet")
    for variant in order:
        for gpus in sorted(summaries[variant]):
            print(result_line(summaries[variant], gpus, variant, checks, law_r2))


def _scale(args: argparse.Namespace, switch_costs: tuple[float, float]) -> None:
    from megatron_cona.lawsim.evaluate import SimOptions, run_sim

    opts = SimOptions(**{k: v for k, v in vars(args).items()
                         if k in SimOptions.__dataclass_fields__})
    print_scale(run_sim(opts, switch_costs))


# ------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cona", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="enumerate, filter and rank candidate strategies")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=51200)
    p.add_argument("--candidates", default="all")
    p.add_argument("--global-batch-range", type=_int_pair, default=(8, 128))
    p.add_argument("--micro-batches", type=_int_list, default=(1, 2, 4, 8))
    p.add_argument("--device", default="a100-80gb")
    p.add_argument("--precision", default="fp16-mixed")
    p.add_argument("--noise-scale", type=float, default=math.nan,
                   help="gradient noise scale (samples) for the efficiency term; "
                   "default: none (rank by throughput)")
    p.add_argument("--base-batch", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    sub.add_parser("run", help="train: megatron_cona.pretrain_gpt flags (use under torchrun)",
                   add_help=False)
    sub.add_parser("ttp", help="time-to-perplexity evaluation (cona ttp --help)", add_help=False)
    p = sub.add_parser("scale", help="law-based simulation at the paper's scale",
                       parents=[scale_parser()], add_help=False, conflict_handler="resolve")
    p.add_argument("--switch-costs", type=_switch_costs, required=True,
                   help="FIXED,BATCH: measured seconds of a layout switch's fixed part and of "
                   "a batch switch (benchmarks/bench_cona_scale.py measures them)")
    p = sub.add_parser("plot", help="plot a run's strategy timeline or a TTP report")
    p.add_argument("--log", type=Path, help="--cona-log file of a run")
    p.add_argument("--ttp", type=Path, help="ttp.json written by cona ttp (one plot per case "
                   "into the --out directory)")
    p.add_argument("--out", type=Path, required=True)
    return parser


_TE_APEX = "Transformer Engine and Apex are not installed"


def _fold_te_apex_warnings() -> list[bool]:
    """megatron-core warns from four modules that Transformer Engine and Apex are missing: those
    are not shown (other warnings are left as they are); the list returned gets an entry when
    one was folded, so that a command that succeeds says it once."""
    show, folded = warnings.showwarning, []

    def fold(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if _TE_APEX not in str(message):
            return show(message, category, filename, lineno, file, line)
        folded.append(True)

    warnings.showwarning = fold
    return folded


def main(argv: list[str] | None = None) -> int:
    shown = warnings.showwarning
    folded = _fold_te_apex_warnings()
    try:
        rc = _main(argv)
    finally:
        warnings.showwarning = shown
    if rc == 0 and folded:
        print(f"cona: note: {_TE_APEX}: megatron-core used its local kernels and Torch "
              "optimizers (its warnings about it folded into this line)", file=sys.stderr)
    return rc


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] in (["run"], ["ttp"]):
            if argv[0] == "ttp":
                _ttp(argv[1:])
            else:
                import torch

                if not torch.cuda.is_available() and "--help" not in argv and "-h" not in argv:
                    raise CliError(CPU_HINT.format(cmd="pretrain --nproc N -- ..."))
                from megatron_cona.pretrain_gpt import main as pretrain_main

                pretrain_main(argv[1:])
            return 0
        args = _parser().parse_args(argv)
        if args.command == "plan":
            _plan(args)
        elif args.command == "scale":
            _scale(args, args.switch_costs)
        else:
            from megatron_cona.plot import plot_run_timeline, plot_ttp

            if bool(args.log) == bool(args.ttp):
                raise CliError("plot: give exactly one of --log or --ttp")
            if args.log:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                print(plot_run_timeline(args.log, args.out))
            else:
                import json

                report = json.loads(args.ttp.read_text())
                args.out.mkdir(parents=True, exist_ok=True)
                for case in report["cases"]:
                    print(plot_ttp(case, report["note"],
                                   args.out / f"ttp_{case['tag'].replace('/', '_')}.png"))
        return 0
    except (CliError, ValueError, OSError, KeyError) as err:
        print(f"cona: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
