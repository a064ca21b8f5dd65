#!/usr/bin/env python
"""Time-to-perplexity: best static strategy vs CONA vs the oracle chain.

Training progress is REAL (tiny megatron-core GPT, byte-level CPython stdlib sources, 2 gloo CPU
ranks); the clock is SIMULATED: GPT 1.3B iteration times on 8x A100 80GB (measured vTrain times
where available, the time predictor otherwise). The static baseline's learning rate is tuned by
a sweep first. Last line: ``speedup_vs_static=X gap_to_oracle=Y%`` (goal: X >= 1.4, Y <= 2.6).
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
            print(f"[{time.time() - start:5.0f}s] {name:12s} samples {point.samples:6d}  "
                  f"sim {point.sim_time:7.1f}s  val loss {point.val_loss:.4f}  "
                  f"{point.strategy}  phi {point.noise_scale:.1f}", flush=True)

    return run_ttp(opts, progress)


def main() -> None:
    from megatron_cona.cli import print_ttp
    from megatron_cona.ttp import TTPOptions
    from tests.support.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--quick", action="store_true", help="small budget (development)")
    args = parser.parse_args()
    if args.quick:
        opts = TTPOptions(out=args.out, static_samples=4096, interval_samples=256)
    else:
        opts = TTPOptions(out=args.out, static_samples=24576, interval_samples=512,
                          lr_sweep=(1e-3, 2e-3, 4e-3))
    t0 = time.time()
    report = run_distributed(_worker, 2, opts, timeout=1500, threads=1)[0]
    print(f"wall time {time.time() - t0:.0f}s; plot {args.out / 'ttp.png'}; "
          f"report {args.out / 'ttp.json'}")
    print_ttp(report)


if __name__ == "__main__":
    main()
