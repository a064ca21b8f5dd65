"""Benchmark: memory-predictor accuracy on held-out model families and sizes.

Loads the shipped ground truth (``predictors/data/memory_ground_truth.csv``; ``--collect``
re-collects / extends it first), trains the LightGBM residual with each family (and the
full-size models) held out, and evaluates. The OOM verdict adds the margin model's predicted
uncertainty for each configuration (or ``--margin``) plus the modelled CUDA context. The last line is
``mape_heldout=X% oom_verdict_accuracy=Y%`` (goal X <= 3, Y = 100).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from predictors.memory.collect import GROUND_TRUTH_CSV, collect
from predictors.memory.evaluate import evaluate, format_report, plot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collect", action="store_true", help="collect missing ground truth first")
    ap.add_argument("--margin", type=float, default=None,
                    help="fixed safety margin (default: predicted per configuration)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.collect or not GROUND_TRUTH_CSV.exists():
        collect(GROUND_TRUTH_CSV)
    rep = evaluate(GROUND_TRUTH_CSV, margin=args.margin)
    print(format_report(rep))
    print(f"plot: {plot(rep)}; {len(rep.rows)} held-out predictions in "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"mape_heldout={rep.mape_heldout:.2f}% oom_verdict_accuracy={rep.oom_accuracy:.1f}%")


if __name__ == "__main__":
    main()
