#!/usr/bin/env python
"""Time-to-perplexity: CONA vs the offline planner, the hindsight-best static strategy,
Megatron's batch ramp-up (swept), Pollux (adaptdl's own goodput code, when installed) and the
DP bound over every (global batch x layout) sequence.

Training progress is REAL: cached curves of small megatron-core models (GPT-style, Llama-style)
on CPython stdlib sources, one per (family, seed, global batch, LR), trained once (1-rank CPU
processes) and cached by provenance; every run re-trains one cached curve and requires it to
match bit for bit. The clock is SIMULATED: vTrain-measured GPT-3 1.3B iteration times on
8x A100, switch cost = measured fixed cost + reshard-plan bytes over NVLink. Two LR variants:
``sqrt`` (one tuned base LR, sqrt-scaled) and ``table`` (per-batch LR from one sweep).

Building the curve set the first time is long (``--build-only`` does only that); with the cache
in place the default run takes a few minutes. ``--fresh`` re-trains everything; ``--smoke`` is a
tiny end-to-end check (one family, one seed, short budget; its numbers mean nothing).

Last line (medians over families x seeds, ``table`` variant; ``sqrt`` just above):
``ref_vs_best_static=R ref_switches=K speedup_vs_planner=A speedup_vs_tuned_static=B
speedup_vs_rampup=C speedup_vs_pollux=D gap_to_bound=E%``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from cona_pollux import register_pollux

    from megatron_cona.cli import _ttp_parser, print_ttp
    from megatron_cona.ttp import TTPOptions, run_ttp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     parents=[_ttp_parser()], add_help=False,
                                     conflict_handler="resolve")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny end-to-end check (one family and seed, short budget)")
    parser.add_argument("--build-only", action="store_true",
                        help="build the curve cache and stop before the cases")
    args = vars(parser.parse_args())
    smoke = args.pop("smoke")
    if smoke:
        args.update(families=("gpt",), seeds=(1234,), budget_samples=512, batches=(8, 16, 64),
                    lr_grid=(2e-3,), lr_multipliers=(1.0,), rampup_starts=(16,),
                    rampup_fractions=(0.25,), interval_samples=64, max_samples_factor=1.5)
    opts = TTPOptions(**args)
    pollux = register_pollux()
    print(f"pollux: {pollux}", flush=True)
    t0 = time.time()
    from megatron_cpu.launch import run_distributed

    report = run_ttp(opts, run_distributed,
                     lambda msg: print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True))
    if opts.build_only:
        print(f"curve cache built in {time.time() - t0:.0f}s: {opts.cache}")
        return
    print(f"wall time {time.time() - t0:.0f}s; plots {opts.out}/ttp_<family>_s<seed>_<variant>"
          f".png; report {opts.out / 'ttp.json'}")
    print_ttp(report)


if __name__ == "__main__":
    main()
