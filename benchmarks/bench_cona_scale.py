#!/usr/bin/env python
"""CONA at the paper's scale: the law-based simulation (``megatron_cona.lawsim``).

Training progress is SIMULATED from published laws (Kaplan et al. 2020 L(N, S_min) and
B_crit(L); McCandlish et al. 2018's dS_min = 1/(1 + B_crit/B)); every constant is cited in
``megatron_cona/lawsim/constants.py`` and docs/cona.md. The clock is vTrain's measured 8x A100
times (GPT-3 1.3B, 8 GPUs) or the project's time predictor (every other case, "predicted
clock"). CONA's real ConaSession decides from simulated probe readings (GradStats) and the
clock; rivals: the planner (paper's batch), hindsight-tuned static, Megatron's ramp-up (swept),
Pollux (adaptdl's own GoodputFunction / fit_perf_params, when installed: .venv-bench), Seesaw
(swept); references: the per-interval best with the law's state known (``oracle``) and a lower
bound (continuous strategy changes, free switches) that no chain may beat.

The switch costs' fixed parts are measured here on the real CONA runtime (2 CPU ranks). The law
itself is checked on our own Megatron-Core training first (``cona_law_check.py``: McCandlish's
hyperbola fitted to committed real curves at 6 batches x 3 loss targets, one curve re-trained
bit for bit; its worst R^2 is ``law_r2``). Results are written as each (family, GPU count) finishes
(``<out>/sim.json``, one plot per case). Default run: 3 families x 3 GPU counts x 7 law
variants, the nine (family, GPU count) worlds over ``--jobs`` worker processes (each registers
Pollux first), under 10 minutes on 2 cores.

Output: the sanity checks first; per case every chain's time; the worst case per law variant
and GPU count against every rival (with the case); then one line per law variant and GPU count
(medians over 3 families x 2 targets), Kaplan's law last and its 512-GPU line the very last:
``gpus=G law=V sim_checks=P/N speedup_vs_planner=A speedup_vs_tuned_static=B
worst_vs_tuned_static=W speedup_vs_rampup=C speedup_vs_pollux=D speedup_vs_seesaw=S
gap_to_exact_bound=E% gap_to_relaxed_bound=E2% law_r2=Q``. What did not run prints
``not_run`` and a line saying why. Pollux (adaptdl) must run: without it the run fails with the
reason, unless ``--skip pollux`` is given.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure_switch_costs() -> tuple[float, float]:
    """Median seconds of a real in-memory layout switch's fixed part and of a batch switch of
    the CONA runtime on 2 CPU ranks."""
    from cona_curves import switch_cost_worker

    from megatron_cpu.launch import run_distributed

    return tuple(run_distributed(switch_cost_worker, 2, timeout=600, threads=1)[0])


def main() -> None:
    from cona_pollux import register_pollux
    from rich.progress import Progress

    from megatron_cona.cli import print_scale, scale_parser, switch_costs_arg
    from megatron_cona.lawsim.evaluate import SimOptions, run_sim

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     parents=[scale_parser()], add_help=False,
                                     conflict_handler="resolve")
    parser.add_argument("--switch-costs", type=switch_costs_arg,
                        default=None, help="FIXED,BATCH seconds instead of measuring them")
    parser.add_argument("--smoke", action="store_true",
                        help="one family, 64 GPUs, Kaplan's law only (a quick end-to-end check)")
    parser.add_argument("--no-law-check", dest="law_check", action="store_false",
                        help="leave out the law check on our own training (law_r2=not_run)")
    args = vars(parser.parse_args())
    costs, smoke, check = args.pop("switch_costs"), args.pop("smoke"), args.pop("law_check")
    if smoke:
        args.update(families=("gpt3-1.3b",), gpus=(64,), variants=("kaplan",))
    opts = SimOptions(**{k: v for k, v in args.items() if k in SimOptions.__dataclass_fields__})
    pollux = register_pollux()
    print(f"pollux: {pollux}", flush=True)
    if pollux.startswith("NOT RUN") and "pollux" not in opts.skip:
        sys.exit(f"bench_cona_scale: a rival cannot run -- {pollux}; or pass --skip pollux to "
                 "leave it out knowingly")
    t0 = time.time()
    law_r2, law_lines = math.nan, []
    if check:
        from cona_law_check import LawOptions, law_check, plot_law

        from megatron_cpu.launch import run_distributed

        law = law_check(LawOptions(), run_distributed, say=lambda m: print(m, flush=True))
        law_r2, law_lines = law.r2, law.lines()
        print(f"law check on our own training ({law.wall_s:.0f}s; plot "
              f"{plot_law(law, opts.out / 'law_check.png')}):", flush=True)
        print("\n".join(law_lines), flush=True)
    if costs is None:
        costs = measure_switch_costs()
        print(f"switch costs measured on the CONA runtime: layout fixed part {costs[0]:.3f} s, "
              f"batch switch {costs[1]:.4f} s ({time.time() - t0:.0f}s)", flush=True)
    with Progress(transient=True) as progress:
        report = run_sim(opts, costs, progress,
                         say=lambda m: progress.console.print(f"[{time.time() - t0:5.0f}s] {m}",
                                                              markup=False, highlight=False),
                         init=register_pollux)
    print(f"wall time {time.time() - t0:.0f}s; report {opts.out / 'sim.json'}; plots "
          f"{opts.out}/sim_<family>_<gpus>gpu_<variant>.png")
    print("\n".join(law_lines[:-1]))
    print_scale(report, law_r2)


if __name__ == "__main__":
    main()
