#!/usr/bin/env python
"""Run CONA entry points on CPU-only machines (gloo ranks spawned here).

megatron-core hard-codes ``torch.cuda`` calls (DDP buffers, RNG tracker), so on a machine without
a GPU every rank first installs the CPU redirect of ``megatron_cpu.cuda_redirect`` (the gloo
ranks are started by ``megatron_cpu.launch``). The plugin (``megatron_cona``) never does that
itself; this launcher, outside the plugin, does.

    python scripts/cona_cpu.py pretrain --nproc 4 -- --num-layers 2 --hidden-size 64 ... --cona
    python scripts/cona_cpu.py demo --out out

On GPUs use ``torchrun --nproc-per-node N -m megatron_cona.pretrain_gpt ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "64",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--train-iters", "36", "--lr", "2e-3", "--lr-decay-style", "constant",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "6",
    "--eval-interval", "0", "--cona", "--cona-interval", "6",
    "--cona-candidates", "dp4tp1pp1,dp2tp2pp1,dp1tp2pp2", "--cona-global-batch-range", "8,64",
    "--cona-patience", "1", "--cona-cooldown", "0",
]


def _pretrain_worker(rank: int, world: int, argv: list[str]) -> dict:
    import logging

    from megatron_cona.arguments import add_cona_args
    from megatron_cona.pretrain_gpt import parse_args, train

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s",
                        force=True)
    logging.getLogger("megatron_cona").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    summary = train(parse_args(argv, extra_args_provider=add_cona_args))
    return summary.__dict__


def spawn(fn, nproc: int, *args, timeout: float = 1800.0):
    from megatron_cpu.launch import run_distributed

    return run_distributed(fn, nproc, *args, timeout=timeout, threads=max(1, 2 // nproc))


def pretrain(nproc: int, argv: list[str]) -> dict:
    return spawn(_pretrain_worker, nproc, argv)[0]


def demo(out: Path) -> None:
    from megatron_cona.plot import plot_run_timeline

    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "cona_demo_decisions.jsonl"
    t0 = time.time()
    summary = pretrain(4, [*DEMO_ARGS, "--cona-log", str(log_path)])
    png = plot_run_timeline(log_path, out / "cona_demo_timeline.png", summary["losses"])
    (out / "cona_demo_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"CONA demo: 4 gloo ranks, {len(summary['losses'])} iterations in {time.time() - t0:.0f}s"
          f", loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f}")
    for sw in summary["switches"]:
        print(f"  iteration {sw['iteration']}: {sw['from']} -> {sw['to']} "
              f"({sw['seconds']:.2f}s, tensors moved: {sw['moved_tensors']})")
    print(f"timeline plot: {png}; decisions: {log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pretrain", help="megatron_cona.pretrain_gpt on N CPU ranks")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("args", nargs=argparse.REMAINDER)
    d = sub.add_parser("demo", help="CONA switching strategies on 4 gloo ranks")
    d.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    if args.command == "pretrain":
        rest = args.args[1:] if args.args[:1] == ["--"] else args.args
        pretrain(args.nproc, rest)
    else:
        demo(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
