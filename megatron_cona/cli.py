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
    p = argparse.ArgumentParser(prog="cona ttp", description="Time-to-perplexity: offline "
                                "planner, best static, Megatron ramp-up, Pollux-style, CONA and "
                                "the branch-and-measure oracle; SIMULATED clock, REAL training.")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--families", type=_str_list, default=d.families,
                   help="small models that really train: gpt, llama (comma-separated)")
    p.add_argument("--seeds", type=_int_list, default=d.seeds)
    p.add_argument("--target-gpus", type=int, default=d.target_gpus)
    p.add_argument("--target-device", default=d.target_device)
    p.add_argument("--user-global-batch", type=int, default=d.user_global_batch)
    p.add_argument("--global-batch-range", type=_int_pair, default=d.global_batch_range)
    p.add_argument("--micro-batches", type=_int_list, default=d.micro_batches)
    p.add_argument("--budget-samples", type=int, default=d.budget_samples,
                   help="length of the offline planner's run; its final loss is the target")
    p.add_argument("--interval-samples", type=int, default=d.interval_samples)
    p.add_argument("--lr-sweep", type=_float_list, default=d.lr_sweep)
    p.add_argument("--min-gain", type=float, default=d.min_gain)
    return p


def ttp_options(argv: list[str]):
    from megatron_cona.ttp import TTPOptions

    return TTPOptions(**vars(_ttp_parser().parse_args(argv)))


def ttp_result_line(report: dict) -> str:
    """The benchmark's last line: medians over every (family, seed) case."""
    s = report["summary"]
    return (f"speedup_vs_planner={s['speedup_vs_planner']['median']:.2f} "
            f"speedup_vs_tuned_static={s['speedup_vs_tuned_static']['median']:.2f} "
            f"speedup_vs_rampup={s['speedup_vs_rampup']['median']:.2f} "
            f"speedup_vs_pollux={s['speedup_vs_pollux']['median']:.2f} "
            f"gap_to_oracle={s['gap_to_oracle_pct']['median']:.1f}%")


def print_ttp(report: dict) -> None:
    clock, pred = report["clock"], report["predictor"]
    print(f"NOTE: {report['note']}")
    print(f"clock: {clock['rule']}; fixed layout-switch cost {clock['fixed_layout_switch_s']:.3f}"
          f" s and batch switch {clock['batch_switch_s']:.4f} s (measured here), link "
          f"{clock['link_bytes_per_s'] / 1e9:.0f} GB/s; lookups {clock['exact_lookups']} "
          f"measured, {clock['line_lookups']} from a measured layout's line")
    print(f"CONA's predictor: trained on {pred['train_rows']} vTrain rows without group "
          f"{pred['held_out_group']}; its MAPE on the charged rows {pred['held_out_mape_pct']:.2f}%"
          f"; {len(report['candidates'])} candidates")
    for case in report["cases"]:
        print(f"{case['family']} seed {case['seed']}: target ppl {case['target_ppl']:.3f} "
              f"(planner {case['planner_strategy']}, lr {case['lr']:g})")
        for name, run in case["runs"].items():
            chain = " -> ".join(dict.fromkeys(p["strategy"] for p in run["points"]))
            print(f"  {name:8s} TTP {run['ttp_s']:9.1f} s  switches {len(run['switches']):2d}  "
                  f"{chain[:120]}")
    for name, m in report["summary"].items():
        print(f"{name}: median {m['median']:.3f} (min {m['min']:.3f}, max {m['max']:.3f}) over "
              f"{len(m['values'])} cases")
    print(f"wall {report['wall_s']:.0f} s")
    print(ttp_result_line(report))


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
    p.add_argument("--ttp", type=Path, help="ttp.json written by cona ttp (one plot per case "
                   "into the --out directory)")
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
            if args.log:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                print(plot_run_timeline(args.log, args.out))
            else:
                import json

                report = json.loads(args.ttp.read_text())
                args.out.mkdir(parents=True, exist_ok=True)
                for case in report["cases"]:
                    print(plot_ttp(case, report["note"],
                                   args.out / f"ttp_{case['family']}_s{case['seed']}.png"))
        return 0
    except (CliError, ValueError, OSError, KeyError) as err:
        print(f"cona: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
