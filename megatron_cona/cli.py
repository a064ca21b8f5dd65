"""``cona``: plan candidate strategies, train with CONA, evaluate time-to-perplexity, plot.

    cona plan --world 8 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
              --seq-length 1024 --global-batch-range 16,128 --device a100-80gb
    torchrun --nproc-per-node 8 -m megatron_cona.cli run <Megatron-LM flags> --cona ...
    cona ttp --out out                # GPUs; CPU: python scripts/cona_cpu.py ttp --nproc 2
    cona plot --log cona.jsonl --out out/cona_timeline.png

Errors print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
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
    table = Table(title=f"{len(cands.kept)} candidates on {args.world}x {args.device} "
                  f"({args.precision}); goodput with noise scale {args.noise_scale}")
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
    p = argparse.ArgumentParser(prog="cona ttp", description="Time-to-perplexity: static vs "
                                "CONA vs oracle chain; SIMULATED clock, REAL training progress.")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--target-gpus", type=int, default=d.target_gpus)
    p.add_argument("--target-device", default=d.target_device)
    p.add_argument("--target-precision", default=d.target_precision)
    p.add_argument("--vtrain-csv", type=Path, default=d.vtrain_csv,
                   help="measured A100 iteration times (vTrain); missing: predictor only")
    p.add_argument("--all-candidates", dest="measured_only", action="store_false",
                   help="also candidates vTrain did not measure (the clock then uses the "
                   "time predictor for them)")
    p.add_argument("--static-global-batch", type=int, default=d.static_global_batch)
    p.add_argument("--global-batch-range", type=_int_pair, default=d.global_batch_range)
    p.add_argument("--micro-batches", type=_int_list, default=d.micro_batches)
    p.add_argument("--static-samples", type=int, default=d.static_samples)
    p.add_argument("--interval-samples", type=int, default=d.interval_samples)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr-sweep", type=_float_list, default=d.lr_sweep,
                   help="tune the static baseline's LR over these (comma-separated) first")
    p.add_argument("--min-gain", type=float, default=d.min_gain)
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def ttp_options(argv: list[str]):
    from megatron_cona.ttp import TTPOptions

    return TTPOptions(**vars(_ttp_parser().parse_args(argv)))


def print_ttp(report: dict) -> None:
    print(f"NOTE: {report['note']}")
    print(f"target validation perplexity {report['target_ppl']:.3f} (static run's final); "
          f"static strategy {report['static_strategy']}; clock lookups: "
          f"{report['clock_measured_lookups']} measured (vTrain), "
          f"{report['clock_predicted_lookups']} predicted; base LR {report['lr']:g}"
          + (f" (static sweep: {report['static_lr_sweep']})" if len(report['static_lr_sweep']) > 1
             else ""))
    for name, run in report["runs"].items():
        chain = " -> ".join(dict.fromkeys(p["strategy"] for p in run["points"]))
        print(f"  {name:7s} TTP {run['ttp_s']:9.1f} s (simulated)  switches "
              f"{len(run['switches']):2d}  chain: {chain}")
    print(f"oracle speedup vs static {report['oracle_speedup_vs_static']:.2f}x")
    gap = report["gap_to_oracle_pct"]
    print(f"speedup_vs_static={report['speedup_vs_static']:.2f} "
          f"gap_to_oracle={gap:.1f}%" if math.isfinite(gap) else "gap_to_oracle=inf%")


def _ttp(rest: list[str]) -> None:
    import torch

    opts = ttp_options(rest)  # parses first, so --help works everywhere
    if not torch.cuda.is_available():
        raise CliError(CPU_HINT.format(cmd="ttp --nproc 2 " + " ".join(rest)))
    import torch.distributed as dist

    from megatron_cona.pretrain_gpt import init_distributed
    from megatron_cona.ttp import run_ttp

    init_distributed(None)
    report = run_ttp(opts)
    if dist.get_rank() == 0:
        print_ttp(report)


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
    p = sub.add_parser("plot", help="plot a run's strategy timeline or a TTP report")
    p.add_argument("--log", type=Path, help="--cona-log file of a run")
    p.add_argument("--ttp", type=Path, help="ttp.json written by cona ttp")
    p.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
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
        else:
            from megatron_cona.plot import plot_run_timeline, plot_ttp

            if bool(args.log) == bool(args.ttp):
                raise CliError("plot: give exactly one of --log or --ttp")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            if args.log:
                print(plot_run_timeline(args.log, args.out))
            else:
                import json

                print(plot_ttp(json.loads(args.ttp.read_text()), args.out))
        return 0
    except (CliError, ValueError, OSError, KeyError) as err:
        print(f"cona: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
