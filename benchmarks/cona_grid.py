#!/usr/bin/env python
"""CONA's development grid: the law-based simulation over several seeds of the probe's and the
loss readings' noise, CONA against the tuned static batch only (docs/cona.md, the sessions'
"development grid" paragraphs).

One trajectory's fate turns on a few noisy comparisons, so a controller change is judged over
seeds, not on the benchmark's one (``bench_cona_scale.py`` runs seed 0). Per seed: every law
variant x family x GPU count (``cona scale``'s worlds over ``--jobs`` worker processes), the
switch costs fixed (default 0.039 s / 0.0008 s: the simulated seconds then do not depend on the
machine), no exact DP, only the chains a ratio needs (``static``, ``cona``; ``oracle`` and the
relaxed bound come along). Each seed's ``sim.json`` is written under ``<out>/seed<N>/`` as it
finishes, so a killed run keeps the seeds it finished. About 5 minutes a seed on 2 cores.

Output, per case-target the tuned static batch's time over CONA's (>= 1: CONA no slower):
the geometric mean, the smallest, how many are >= 0.95 and >= 1.0, and the rows (law variant x
GPU count) whose worst over families, targets and seeds is >= 0.95 (the issue's W goal, over
seeds); with ``--compare DIR`` (an earlier grid's ``--out``) both on the case-targets they
share, and each row's worst before -> after.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictors.flag_values import flag_type, parse_distinct  # noqa: E402

# (variant, GPU count, family, target, seed)
Key = tuple[str, int, str, str, int]
SKIP = ("planner", "rampup", "seesaw", "pollux")  # the grid compares CONA with static only


def speedups(cases: Iterable[dict], seed: int) -> dict[Key, float]:
    """CONA's speedup over the tuned static batch per case-target of one seed's cases
    (``sim.json``'s ``cases``), as the benchmark computes it."""
    from megatron_cona.lawsim.evaluate import ratios

    return {(c["variant"], c["gpus"], c["family"], target, seed):
            ratios(c, target)["speedup_vs_tuned_static"]
            for c in cases for target in c["targets"]}


def load(out: Path) -> dict[Key, float]:
    """Every finished seed under ``out`` (an earlier grid, for ``--compare``)."""
    found: dict[Key, float] = {}
    for path in sorted(out.glob("seed*/sim.json")):
        seed = int(path.parent.name.removeprefix("seed"))
        found.update(speedups(json.loads(path.read_text())["cases"], seed))
    return found


def rows(r: dict[Key, float]) -> dict[tuple[str, int], float]:
    """Each (variant, GPU count)'s worst case-target over families, targets and seeds."""
    worst: dict[tuple[str, int], float] = {}
    for key, value in r.items():
        worst[key[:2]] = min(worst.get(key[:2], math.inf), value)
    return worst


def summary(r: dict[Key, float]) -> str:
    values = list(r.values())
    if not values:
        return "n=0"
    geomean = math.exp(sum(map(math.log, values)) / len(values))
    worst = rows(r)
    return (f"n={len(values)} geomean={geomean:.4f} min={min(values):.3f} "
            f">=0.95:{sum(v >= 0.95 for v in values)} >=1.0:{sum(v >= 1.0 for v in values)} "
            f"rows_ok={sum(w >= 0.95 for w in worst.values())}/{len(worst)}")


def compare(before: dict[Key, float], after: dict[Key, float]) -> list[str]:
    """Both grids on the case-targets they share, and each row's worst before -> after (a
    star where the row crosses 0.95)."""
    shared = sorted(set(before) & set(after))
    b = {k: before[k] for k in shared}
    a = {k: after[k] for k in shared}
    lines = [f"before {summary(b)}", f"after  {summary(a)}"]
    wb, wa = rows(b), rows(a)
    for row in sorted(wb):
        star = " *" if (wb[row] >= 0.95) != (wa[row] >= 0.95) else ""
        lines.append(f"{row[0]:>11s} {row[1]:>4d} GPUs  {wb[row]:.3f} -> {wa[row]:.3f}{star}")
    return lines


def _seeds(text: str) -> tuple[int, ...]:
    """Each >= 0 (numpy's generators take no negative; SimOptions refused one only once the
    seeds before it had run, ~5 minutes each) and each once (a repeat ran its seed twice and
    counted it twice in every summary)."""
    return parse_distinct(text, 0)


def grid_parser() -> argparse.ArgumentParser:
    """``cona scale``'s flags plus the grid's own."""
    from megatron_cona.cli import scale_parser, switch_costs_arg

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     parents=[scale_parser()], add_help=False,
                                     conflict_handler="resolve")
    parser.add_argument("--out", type=Path, default=Path("out/cona_grid"))
    parser.add_argument("--seeds", type=flag_type(_seeds), default=(0, 1, 2),
                        help="comma list of seeds, each >= 0 and each once")
    parser.add_argument("--switch-costs", type=switch_costs_arg,
                        default=(0.039, 0.0008), help="FIXED,BATCH seconds (fixed: the grid's "
                        "simulated seconds do not depend on the machine)")
    parser.add_argument("--compare", type=Path, default=None,
                        help="an earlier grid's --out: both on the case-targets they share")
    return parser


def main(argv: list[str] | None = None) -> None:
    from rich.progress import Progress

    from megatron_cona.lawsim.evaluate import SimOptions, run_sim

    args = vars(grid_parser().parse_args(argv))
    seeds, costs, out = args.pop("seeds"), args.pop("switch_costs"), args.pop("out")
    before = args.pop("compare")
    if before is not None and not any(before.glob("seed*/sim.json")):
        sys.exit(f"cona_grid: --compare {before}: no finished seed there (seed<N>/sim.json)")
    fields = {k: v for k, v in args.items() if k in SimOptions.__dataclass_fields__
              and k not in ("seed", "out", "exact_variants", "skip")}
    after: dict[Key, float] = {}
    with Progress(transient=True) as progress:
        for seed in seeds:
            opts = SimOptions(**fields, out=out / f"seed{seed}", seed=seed, exact_variants=(),
                              skip=SKIP)
            report = run_sim(opts, costs, progress, say=lambda m: None)
            found = speedups(report["cases"], seed)
            after.update(found)
            progress.console.print(f"seed {seed}: {summary(found)}", markup=False,
                                   highlight=False)
    print(f"grid {out}, seeds {','.join(map(str, seeds))}: {summary(after)}")
    for row, worst in sorted(rows(after).items()):
        print(f"{row[0]:>11s} {row[1]:>4d} GPUs  worst {worst:.3f}")
    if before is not None:
        print("\n".join(compare(load(before), after)))


if __name__ == "__main__":
    main()
