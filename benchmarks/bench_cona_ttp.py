#!/usr/bin/env python
"""Time-to-perplexity: CONA vs the offline planner, the best static strategy in hindsight,
Megatron's batch ramp-up, Pollux-style batch+LR adaptation, and the branch-and-measure oracle.

Training progress is REAL (small megatron-core GPT-style and Llama-style models, byte-level
CPython stdlib sources, 2 gloo CPU ranks, 3 seeds); the clock is SIMULATED: vTrain-measured
GPT-3 1.3B iteration times on 8x A100, switch cost = measured fixed cost + reshard-plan bytes over
NVLink. CONA's time predictor is trained without the model-size group the clock charges.

Last line (medians over families x seeds):
``speedup_vs_planner=A speedup_vs_tuned_static=B speedup_vs_rampup=C speedup_vs_pollux=D
gap_to_oracle=E%`` (goals: A >= 1.4; B, C, D >= 1.1; E <= 2.6).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(rank: int, world: int, opts):
    import logging

    from megatron_cona.ttp import run_ttp

    logging.basicConfig(level=logging.WARNING, force=True)
    start = time.time()

    def progress(name, point):
        if rank == 0:
            print(f"[{time.time() - start:5.0f}s] {name:18s} samples {point.samples:6d}  "
                  f"sim {point.sim_time:7.1f}s  val {point.val_loss:.4f}  {point.strategy}",
                  flush=True)

    return run_ttp(opts, progress)


def main() -> None:
    from megatron_cona.cli import print_ttp
    from megatron_cona.ttp import TTPOptions
    from megatron_cpu.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--quick", action="store_true",
                        help="one family, one seed, short budget (development)")
    args = parser.parse_args()
    if args.quick:
        opts = TTPOptions(out=args.out, families=("gpt",), seeds=(1234,), budget_samples=2048,
                          rampup_starts=(16,), rampup_fractions=(0.25,))
    else:
        opts = TTPOptions(out=args.out)
    t0 = time.time()
    report = run_distributed(_worker, 2, opts, timeout=3600, threads=1)[0]
    print(f"wall time {time.time() - t0:.0f}s; plots {args.out}/ttp_<family>_s<seed>.png; "
          f"report {args.out / 'ttp.json'}")
    print_ttp(report)


if __name__ == "__main__":
    main()
