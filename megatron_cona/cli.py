"""``cona``: plan candidate strategies, train with CONA, simulate it at scale, plot.

    cona plan --world 8 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
              --seq-length 1024 --global-batch-range 16,128 --device a100-80gb
    torchrun --nproc-per-node 8 -m megatron_cona.cli run <Megatron-LM flags> --cona ...
    cona scale --switch-costs 0.5,0.01 --out out/cona_scale   # law-based simulation at scale
    cona plot --log cona.jsonl --out out/cona_timeline.png

Errors print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from megatron_cona.arguments import parse_batch_range
from megatron_cona.candidates import MAX_WORLD
from predictors.flag_values import (
    flag_type,
    parse_count,
    parse_counts,
    parse_ints,
    parse_positive,
)
from predictors.image_path import image_path_problem
from predictors.spec import StrategyError, TransformerSpec

CPU_HINT = ("no GPU here: megatron-core's CUDA calls must be redirected on CPU, run "
            "`python scripts/cona_cpu.py {cmd}` from the repository instead")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# The errors bad input raises where that input is validated, by (module, class), printed as one
# line like CliError and OSError (a file). A class is looked up only once its module has been
# imported (before that nothing can have raised it), so the check imports nothing. Any other
# error -- a KeyError or ValueError of our own code -- is a bug and keeps its traceback.
INPUT_ERRORS = (
    ("predictors.spec.model", "ModelSpecError"),  # and UnknownModelError, ResolutionError
    ("predictors.spec.strategy", "StrategyError"),  # and the run flags' ConaArgumentError
    ("predictors.spec.precision", "UnknownPrecisionError"),
    ("predictors.devices", "UnknownDeviceError"),
    ("predictors.devices", "UnsupportedPrecisionError"),
    ("megatron_cona.lawsim.law", "LawError"),  # cona scale's options and cases
    ("megatron_cona.lawsim.clock", "ClockError"),  # a case vTrain measured no time for
    ("megatron_cona.plot", "DecisionLogError"),
    ("megatron_cona.data", "DataError"),
    ("megatron_cona.lr_scaling", "LRScalingError"),
    ("megatron_cona.policy", "PolicyError"),
    ("megatron_cona.gns", "GradientStatsError"),  # a non-finite gradient norm
    ("megatron_cona.pretrain_gpt", "TrainingError"),  # a non-finite loss
)


def _is_input_error(err: Exception) -> bool:
    return isinstance(err, CliError | OSError) or any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, name in INPUT_ERRORS if module in sys.modules)


# a size or count that must be >= 1 (0 divided by zero or drew from an empty range)
_count = flag_type(parse_count)


def _count_upto(limit: int) -> Callable[[str], int]:
    """``_count`` no larger than ``limit`` (see PLAN_LIMITS)."""
    def count(text: str) -> int:
        value = _count(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} is over {limit:,} (see docs/cona.md)")
        return value
    return count


# cona plan's ceilings, far above any published model (<= ~130 layers, hidden 25,600,
# vocabularies of 256k, contexts of 10M tokens, batches of ~10^4 sequences), below what the
# time predictor cannot price: it traces every layer (1,000 layers took ~10 s, 10^4 over a
# minute, 10^8 never returned: development runs, 2 loaded cores), and builds meta tensors whose
# sizes overflowed int64 at 10^30 (an OverflowError or TypeError traceback). The world's is the
# candidates' own, which `cona scale` checks too; the global batch's (MAX_GLOBAL_BATCH: a range
# to 10^30 ranked thousands of candidates of 10^26 ms per iteration) is checked by
# parse_batch_range, shared with `cona run`'s --cona-global-batch-range
PLAN_LIMITS = {"world": MAX_WORLD, "num_layers": 1024, "hidden_size": 2**17,
               "seq_length": 2**24, "vocab_size": 2**22}


def _out_dir(text: str) -> Path:
    """A folder to write into: '' (Path('.')) wrote sim.json and a plot per case into the
    current folder without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name the folder to write into (e.g. . for here)")
    return Path(text)


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
    try:
        user = parse_candidate_list(args.candidates)
    except StrategyError as err:
        raise StrategyError(f"--candidates: {err}") from None
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


# ------------------------------------------------------------------------------------ scale


# the longest switch cost taken, 1e30 s (3e22 years: no chain that can avoid such a switch
# pays it): a chain's time sums its switches, and from 1e308 the sum overflowed to inf (cona
# scale's plots raised OverflowError)
MAX_SWITCH_S = 1e30


def switch_costs_arg(text: str) -> tuple[float, float]:
    """``--switch-costs FIXED,BATCH`` (seconds), for ``cona scale`` and the benchmarks that
    share its options."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:  # argparse would say only "invalid switch_costs_arg value"
        parts = []
    if len(parts) != 2 or not all(0 <= x <= MAX_SWITCH_S for x in parts):  # nan fails it too
        raise argparse.ArgumentTypeError(f"{text!r} is not FIXED,BATCH: two seconds from 0 to "
                                         f"{MAX_SWITCH_S:g}")
    return parts[0], parts[1]


def scale_parser() -> argparse.ArgumentParser:
    from megatron_cona.lawsim.evaluate import SimOptions

    d = SimOptions()
    p = argparse.ArgumentParser(prog="cona scale", description="CONA at the paper's scale: a "
                                "SIMULATED training law (Kaplan 2020, McCandlish 2018) driving "
                                "the real controller, every rival and a lower bound.")
    # the integer lists' values (>= 1, each once) are checked by SimOptions, which the
    # benchmarks also build directly
    p.add_argument("--out", type=_out_dir, default=d.out)
    p.add_argument("--families", type=_str_list, default=d.families)
    p.add_argument("--gpus", type=flag_type(parse_ints), default=d.gpus)
    p.add_argument("--variants", type=_str_list, default=d.variants,
                   help=f"law variants: {', '.join(d.variants)}")
    p.add_argument("--micro-batches", type=flag_type(parse_ints), default=d.micro_batches)
    p.add_argument("--pipeline", type=flag_type(parse_ints), default=d.pipeline)
    p.add_argument("--min-gain", type=float, default=d.min_gain)
    p.add_argument("--noise-z", type=float, default=d.noise_z)
    p.add_argument("--first-interval-iterations", type=int, default=d.first_interval_iterations,
                   help="the first decision after this many iterations at the paper's batch")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--exact-variants", type=_str_list, default=d.exact_variants,
                   help="law variants on which the exact DP with the chains' cadence and "
                        "switch costs runs beside the relaxation (default: every one; '' for "
                        "none)")
    p.add_argument("--bound-snap", type=float, default=d.bound_snap,
                   help="round the exact DP's S up to a log grid of this relative step (fewer "
                        "states, still a bound; default 0: exact; else 1e-9 to 1e-5)")
    p.add_argument("--skip", type=_str_list, default=(),
                   help="rivals to leave out: planner, rampup, seesaw, pollux (an unknown name "
                   "is refused)")
    p.add_argument("--jobs", type=int, default=d.jobs,
                   help="worker processes, one (family, GPU count) each at a time (default: "
                        "the CPUs this process may use); the results do not depend on it")
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
    without = [v for v in order if not any(
        "exact_s" in t for c in report["cases"] if c["variant"] == v
        for t in c["chains"].get("bound", {}).values())]
    if without:
        print(f"gap_to_exact_bound=not_run for {', '.join(without)}: left out by "
              "--exact-variants (gap_to_relaxed_bound is against a bound that ignores switch "
              "costs and cadence, so it can only overstate the gap)")
    if not any("pollux" in c["chains"] for c in report["cases"]):
        print("speedup_vs_pollux=not_run: Pollux runs adaptdl's own goodput code, which is not "
              "installed with the plugin (benchmarks/bench_cona_scale.py in `make bench-env`'s "
              "venv runs it)")
    if not math.isfinite(law_r2):
        print("law_r2=not_run: the law check trains on the real Megatron-Core loop from the "
              "repository (benchmarks/cona_law_check.py; bench_cona_scale.py runs it)")
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
    p.add_argument("--world", type=_count_upto(PLAN_LIMITS["world"]), required=True)
    p.add_argument("--num-layers", type=_count_upto(PLAN_LIMITS["num_layers"]), required=True)
    p.add_argument("--hidden-size", type=_count_upto(PLAN_LIMITS["hidden_size"]), required=True)
    p.add_argument("--num-attention-heads", type=_count, required=True)
    p.add_argument("--seq-length", type=_count_upto(PLAN_LIMITS["seq_length"]), required=True)
    p.add_argument("--vocab-size", type=_count_upto(PLAN_LIMITS["vocab_size"]), default=51200)
    p.add_argument("--candidates", default="all")
    p.add_argument("--global-batch-range", type=flag_type(parse_batch_range), default=(8, 128))
    p.add_argument("--micro-batches", type=flag_type(parse_counts), default=(1, 2, 4, 8))
    p.add_argument("--device", default="a100-80gb")
    p.add_argument("--precision", default="fp16-mixed")
    p.add_argument("--noise-scale", type=flag_type(parse_positive), default=math.nan,
                   help="gradient noise scale (samples) for the efficiency term; "
                   "default: none (rank by throughput)")
    p.add_argument("--base-batch", type=_count, default=8)
    p.add_argument("--top", type=_count, default=15)
    sub.add_parser("run", help="train: megatron_cona.pretrain_gpt flags (use under torchrun)",
                   add_help=False)
    p = sub.add_parser("scale", help="law-based simulation at the paper's scale",
                       parents=[scale_parser()], add_help=False, conflict_handler="resolve")
    p.add_argument("--switch-costs", type=switch_costs_arg, required=True,
                   help="FIXED,BATCH: measured seconds of a layout switch's fixed part and of "
                   "a batch switch, each 0 to 1e30 (benchmarks/bench_cona_scale.py measures "
                   "them)")
    p = sub.add_parser("plot", help="plot a run's strategy timeline")
    p.add_argument("--log", type=Path, required=True, help="--cona-log file of a run")
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
        if argv[:1] == ["run"]:
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
            from megatron_cona.plot import plot_run_timeline

            if problem := image_path_problem(args.out, "timeline.png"):  # before the log is read
                raise CliError(f"--out: {problem}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            print(plot_run_timeline(args.log, args.out))
        return 0
    except Exception as err:
        if not _is_input_error(err):
            raise
        # the subcommand, as argparse's own errors say it ("cona plan: error: ...")
        prog = f"cona {argv[0]}" if argv and not argv[0].startswith("-") else "cona"
        print(f"{prog}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
