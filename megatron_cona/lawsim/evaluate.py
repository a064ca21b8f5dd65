"""Running the law-based simulation: build every case (family x GPU count x law variant), run
every registered chain, check the bound, summarize per GPU count. Results are written as each
case finishes (``sim.json``), with a plot per case."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

from megatron_cona.candidates import MAX_WORLD
from megatron_cona.lawsim.cases import (
    FAMILIES,
    MEASURED,
    PREDICTED,
    PredictedTimes,
    SimCase,
    boundaries,
    dynamics_for,
    targets,
)
from megatron_cona.lawsim.chains import CHAINS, ELSEWHERE, SimResult
from megatron_cona.lawsim.checks import run_checks
from megatron_cona.lawsim.constants import value
from megatron_cona.lawsim.law import VARIANTS, LawError
from megatron_cona.policy import PolicyConfig
from predictors.flag_values import check_distinct, check_once
from predictors.spec import ParallelStrategy

NOTE = ("LAW-BASED SIMULATION: training progress from published laws (Kaplan et al. 2020, "
        "McCandlish et al. 2018; every constant cited in docs/cona.md), clock {clock}; "
        "agreement with this simulator is agreement, not accuracy")


# every case's result is measured against these (ratios() and case_line() read them): no --skip
MEASURED_AGAINST = ("cona", "static", "oracle", "bound")
# the relative steps of the exact DP's log grid that still give a bound (SimOptions says why)
BOUND_SNAP = (1e-9, 1e-5)


@dataclass
class SimOptions:
    out: Path = Path("out/cona_scale")
    families: tuple[str, ...] = tuple(FAMILIES)
    gpus: tuple[int, ...] = (8, 64, 512)
    variants: tuple[str, ...] = tuple(VARIANTS)
    device: str = "a100-80gb"
    micro_batches: tuple[int, ...] = (1, 2)
    pipeline: tuple[int, ...] = (1, 2)
    max_tp: int = 8
    batch_span: tuple[float, float] = (1 / 64, 4.0)  # global batches / the paper's batch
    # the first decision after this many iterations at the paper's batch (a real job decides
    # after its first --cona-interval); later intervals: max(that, growth x tokens seen)
    first_interval_iterations: int = 2
    growth: float = 0.05  # later intervals: this fraction of the tokens seen
    end_factor: float = 8.0  # decision boundaries run to this x the compute-optimal tokens
    min_gain: float = 0.01
    patience: int = 1
    cooldown: int = 0
    horizon: float = 20.0
    noise_z: float = 1.0
    seed: int = 0
    # the law variants on which the exact DP runs beside the relaxation (every one: pruned by
    # the relaxation's cost-to-go it takes seconds per case), and an optional log grid its S
    # is rounded up to (0: none, the DP is exact; > 0 stays a bound, for larger grids)
    exact_variants: tuple[str, ...] = tuple(VARIANTS)
    bound_snap: float = 0.0
    skip: tuple[str, ...] = field(default_factory=tuple)
    # worker processes, one (family, GPU count) each at a time; the results do not depend on it
    jobs: int = field(default_factory=lambda: len(os.sched_getaffinity(0))
                      if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def __post_init__(self) -> None:
        for name in self.families:
            if name not in FAMILIES:
                raise LawError(f"families: {name!r} is unknown; choose from "
                               f"{', '.join(FAMILIES)}")
        for field_name in ("variants", "exact_variants"):
            for name in getattr(self, field_name):
                if name not in VARIANTS:
                    raise LawError(f"{field_name}: {name!r} is unknown; choose from "
                                   f"{', '.join(VARIANTS)}")
        # checked here, before any case runs: an unknown name was ignored, a measured-against
        # one failed after every case had run
        skippable = [n for n in (*CHAINS, *ELSEWHERE) if n not in MEASURED_AGAINST]
        for name in self.skip:
            if name in MEASURED_AGAINST:
                reason = "cannot be left out: the results are measured against it"
            elif name not in skippable:
                reason = "is no chain"
            else:
                continue
            raise LawError(f"skip: {name!r} {reason}; chains it may leave out: " + ", ".join(
                n if n in CHAINS else f"{n} (registered by {ELSEWHERE[n]})"
                for n in dict.fromkeys(skippable)))
        if self.jobs < 1:
            raise LawError(f"jobs={self.jobs} must be >= 1 worker process")
        # a repeat would run its cases twice and count them twice in every median, as would a
        # repeated family or variant below
        for name in ("gpus", "micro_batches", "pipeline"):
            check_distinct(getattr(self, name), f"{name}={getattr(self, name)}", error=LawError)
        if max(self.gpus) > MAX_WORLD:  # 10^30 GPUs never returned from the layouts' divisors
            raise LawError(f"gpus={self.gpus}: {max(self.gpus)} is over {MAX_WORLD:,} GPUs")
        for name in ("families", "variants"):
            if not getattr(self, name):
                raise LawError(f"{name}: empty; choose from "
                               f"{', '.join(FAMILIES if name == 'families' else VARIANTS)}")
        # (in the chains to skip or the variants of the exact DP a repeat is a typo, like an
        # unknown name)
        for name in ("families", "variants", "skip", "exact_variants"):
            check_once(getattr(self, name), f"{name}={getattr(self, name)}", error=LawError)
        # the real numbers each need a finite value at or above a floor (nan fails every test)
        for name, floor in (("min_gain", 0.0), ("noise_z", 0.0)):
            if not floor <= getattr(self, name) < math.inf:
                raise LawError(f"{name}={getattr(self, name)} must be a finite number >= {floor:g}")
        # The exact DP rounds S up by a factor of up to e^snap at each of its ~170-240
        # boundaries, and run_case refuses (as a bug) an exact DP more than 0.1% below the
        # relaxation. At 1e-5 it stayed 0.015-0.028% below (development runs: GPT-3 1.3B and
        # Llama-3.2-1B on 8 GPUs, every variant; BERT-Large 8 GPUs; GPT-3 64 GPUs), at 3e-5
        # 0.08%, at 1e-4 0.3%; from 0.1 on a rounded S jumps past a goal and the bound is inf.
        # Below 1e-9 the step is lost in log S's float64 rounding (and under ~1e-300 log S / snap
        # overflows, which put every state past every goal): 0 is the exact DP.
        if self.bound_snap != 0.0 and not BOUND_SNAP[0] <= self.bound_snap <= BOUND_SNAP[1]:
            raise LawError(f"bound_snap={self.bound_snap} must be 0 (the exact DP) or between "
                           f"{BOUND_SNAP[0]:g} and {BOUND_SNAP[1]:g} (a larger step leaves the "
                           "DP's rounding above what the bound check tolerates)")
        if self.first_interval_iterations < 1:
            raise LawError(f"first_interval_iterations={self.first_interval_iterations} must "
                           "be >= 1")
        if self.seed < 0:
            raise LawError(f"seed={self.seed} must be >= 0 (numpy's generators take no negative)")


def architecture(device) -> str:
    """The memory predictor's GPU generation for a device of ``predictors.devices``: Hopper's
    overheads from Hopper on (B200 included: not measured, the larger of the two)."""
    return "pre-hopper" if device.family in ("v100", "a100", "l40s") else "hopper"


@dataclass
class World:
    """What one (family, GPU count) shares across law variants: clock, candidates, CONA's
    time model."""

    clock: object
    label: str
    candidates: list[ParallelStrategy]
    predicted: Callable[[ParallelStrategy], float]
    paper_batch: int
    rejected: int
    prediction_error: float  # the held-out relative error of CONA's time model here


def predicted_world(opts: SimOptions, family: str, gpus: int, switch_costs: tuple[float, float]
                    ) -> World:
    from megatron_cona.candidates import CandidateSpec, PredictorMemory, enumerate_candidates
    from megatron_cona.lawsim.clock import SimulatedClock
    from predictors.devices import get_device
    from predictors.spec.precision import get_precision

    fam = FAMILIES[family]
    spec = fam.spec
    device = get_device(opts.device)
    paper = max(1, round(fam.paper_batch_tokens / spec.seq_length))
    lo, hi = max(1, int(paper * opts.batch_span[0])), int(paper * opts.batch_span[1])
    layouts = tuple((gpus // (tp * pp), tp, pp) for tp in (1, 2, 4, 8) for pp in opts.pipeline
                    if tp <= opts.max_tp and gpus % (tp * pp) == 0)
    found = enumerate_candidates(gpus, spec, CandidateSpec(
        layouts=layouts, micro_batches=opts.micro_batches, global_batch_range=(lo, hi)),
        precision=get_precision(fam.precision), memory_model=PredictorMemory(
            device.memory_bytes / 2**30, architecture(device)),
        memory_limit_bytes=device.memory_bytes)
    times = PredictedTimes(spec, gpus, fam.precision, opts.device)
    link = device.intra_bw if gpus <= device.devices_per_node else device.inter_bw
    clock = SimulatedClock(times, switch_costs[0], switch_costs[1], link)
    kept = found.kept
    # layouts fastest at some batch, plus all-DP (Pollux's): keeps the exact bound tractable
    useful = {min((s for s in kept if s.global_batch_size == b),
                  key=lambda s: (clock.iteration_time(s), s.name)).layout
              for b in {s.global_batch_size for s in kept}}
    useful.add((gpus, 1, 1))
    kept = [s for s in kept if s.layout in useful]
    if paper not in {s.global_batch_size for s in kept}:
        raise LawError(f"{family} on {gpus} GPUs: no feasible candidate at the paper's batch "
                       f"{paper}")
    # CONA's time model is the clock itself here: no prediction error (labelled everywhere)
    return World(clock, PREDICTED, kept, times.iteration_time, paper, len(found.rejected), 0.0)


def vtrain_world(opts: SimOptions, switch_costs: tuple[float, float]) -> World:
    """GPT-3 1.3B on 8 A100s as vTrain measured it (sequence 1,024); CONA ranks with the
    predictor trained without that model-size group: CONA never saw a row the clock charges."""
    from megatron_cona.candidates import CandidateSpec, PredictorMemory, enumerate_candidates
    from megatron_cona.lawsim.clock import GPT_1_3B, HeldOutPredictor, SimulatedClock, VTrainTimes
    from predictors.devices import get_device
    from predictors.spec.precision import get_precision

    device = get_device(opts.device)
    clock = SimulatedClock(VTrainTimes(GPT_1_3B, 8), switch_costs[0], switch_costs[1],
                           device.intra_bw)
    found = enumerate_candidates(8, GPT_1_3B, CandidateSpec(micro_batches=(1, 2, 4, 8)),
                                 precision=get_precision("fp16-mixed"),
                                 memory_model=PredictorMemory(device.memory_bytes / 2**30,
                                                              architecture(device)),
                                 memory_limit_bytes=device.memory_bytes)
    kept = [s for s in found.kept if clock.measured.lookup(s) is not None]
    batches = sorted({s.global_batch_size for s in kept})
    # the paper's 1M-token batch is beyond what vTrain measured: its largest batch instead
    paper = min(max(batches), round(value("gpt3_1p3b_batch_tokens") / GPT_1_3B.seq_length))
    predictor = HeldOutPredictor.train(GPT_1_3B, 8)
    return World(clock, MEASURED, kept, predictor.iteration_time, paper, len(found.rejected),
                 predictor.held_out_mape / 100.0)


def build_case(opts: SimOptions, family: str, gpus: int, variant: str, world: World
               ) -> SimCase:
    fam = FAMILIES[family]
    law = fam.law(fam.spec)
    seq = world.clock.measured.model.seq_length
    batch_tokens = world.paper_batch * seq
    params = fam.spec.num_parameters()
    dyn = dynamics_for(variant, law, batch_tokens, params)
    far = value("tokens_per_param") * params
    first = opts.first_interval_iterations * batch_tokens
    if first >= far / 10:  # 10^30 ran: every chain static to the end, CONA "0.91x" the static
        raise LawError(f"first_interval_iterations={opts.first_interval_iterations}: the first "
                       f"decision ({first:.3g} tokens) comes after {family}'s first target "
                       f"(chinchilla/10: {far / 10:.3g} tokens at the paper's batch of "
                       f"{world.paper_batch}); no controller would decide before it")
    bounds = boundaries(first, opts.growth, opts.end_factor * far)
    return SimCase(
        f"{family}/{gpus}gpu/{variant}", fam, gpus, variant, law, dyn, world.clock, world.label,
        world.candidates, world.predicted, world.paper_batch, bounds,
        targets(dyn, law, batch_tokens, params),
        PolicyConfig(min_gain=opts.min_gain, horizon_intervals=opts.horizon,
                     patience=opts.patience, cooldown=opts.cooldown),
        opts.noise_z, opts.seed, opts.bound_snap, rejected=world.rejected,
        exact_bound=variant in opts.exact_variants,
        prediction_error=world.prediction_error, probe_bias=VARIANTS[variant].probe_bias,
        extra={"device": opts.device,
               "cona_log": opts.out / f"cona_{family}_{gpus}gpu_{variant}_decisions.jsonl"})


def _best(runs: list[SimResult], target: str) -> SimResult:
    return min(runs, key=lambda r: (r.time_to(target), r.name))


def run_case(case: SimCase, skip: tuple[str, ...] = ()) -> dict:
    """Every registered chain on ``case``: per target the (hindsight-best) time, its settings,
    switches and path; bound violations fail the run (raised by the caller)."""
    runs = {name: chain.run(case) for name, chain in CHAINS.items() if name not in skip}
    out = {"tag": case.tag, "family": case.family.name, "gpus": case.gpus,
           "variant": case.variant, "clock": case.clock_label, "seq": case.seq,
           "candidates": len(case.candidates), "rejected_by_memory": case.rejected,
           "paper_batch": case.paper_batch, "intervals": len(case.boundaries) - 1,
           "targets": {n: {"loss": case.loss(g), "s_min": g} for n, g in case.goals.items()},
           "chains": {}, "violations": []}
    for name, results in runs.items():
        per = {}
        for target in case.goals:
            best = _best(results, target) if name != "bound" else next(
                r for r in results if r.settings["target"] == target)
            per[target] = {"time_s": best.time_to(target), "settings": best.settings,
                           "switches": len(best.switches), "path": best.path(),
                           "swept": len(results) if name != "bound" else 1,
                           "points": [asdict(p) for p in best.points]}
            if name == "bound":
                per[target].update({k: best.settings[k] for k in ("relaxed_s", "exact_s")
                                    if k in best.settings})
        out["chains"][name] = per
    for target in case.goals:
        bound = out["chains"]["bound"][target]["time_s"]
        for name, per in out["chains"].items():
            t = per[target]["time_s"]
            if name != "bound" and CHAINS[name].in_bound_space and t < bound * (1 - 1e-9):
                out["violations"].append(f"{name} @ {target}: {t:.6g} s < bound {bound:.6g} s")
        exact = out["chains"]["bound"][target].get("exact_s")
        relaxed = out["chains"]["bound"][target]["relaxed_s"]
        if exact is not None and exact < relaxed * (1 - (1e-3 if case.bound_snap else 1e-6)):
            out["violations"].append(f"exact DP @ {target}: {exact:.6g} s is below the "
                                     f"relaxation {relaxed:.6g} s (snap {case.bound_snap})")
    return out


def ratios(case: dict, target: str) -> dict[str, float]:
    """CONA's speedups over every rival, the reference's over the best static, the gaps to the
    bounds (the exact DP's only where it ran)."""
    c = case["chains"]
    t = {name: per[target]["time_s"] for name, per in c.items()}
    bound = c["bound"][target]
    exact = bound.get("exact_s", math.nan)
    out = {"ref_vs_best_static": t["static"] / t["oracle"],
           "ref_switches": c["oracle"][target]["switches"],
           "gap_to_relaxed_bound": 100.0 * (t["cona"] / bound.get("relaxed_s", t["bound"]) - 1),
           "gap_to_exact_bound": 100.0 * (t["cona"] / exact - 1),
           # the per-interval best's own gap: what no controller that picks each interval's
           # fastest-progressing strategy can close (under B_crit(D) the DP trades progress
           # now for a smaller batch early, which a greedy choice never makes)
           "ref_gap_to_exact_bound": 100.0 * (t["oracle"] / exact - 1)}
    for name, chain in CHAINS.items():
        if chain.rival and name in t:
            key = "tuned_static" if name == "static" else name
            out[f"speedup_vs_{key}"] = t[name] / t["cona"]
    return out


RIVAL_KEYS = ("speedup_vs_planner", "speedup_vs_tuned_static", "speedup_vs_rampup",
              "speedup_vs_pollux", "speedup_vs_seesaw")
KEYS = ("ref_vs_best_static", "ref_switches", *RIVAL_KEYS, "gap_to_exact_bound",
        "gap_to_relaxed_bound", "ref_gap_to_exact_bound")


def summarize(cases: list[dict], variant: str = "kaplan") -> dict[int, dict]:
    """Per GPU count: median, worst (min; for gaps: max) and the count over families x targets
    of ``variant``."""
    out: dict[int, dict] = {}
    for gpus in sorted({c["gpus"] for c in cases}):
        rows = [(f"{c['family']} {t}", ratios(c, t)) for c in cases
                if c["gpus"] == gpus and c["variant"] == variant for t in c["targets"]]
        if not rows:
            continue
        out[gpus] = {}
        for key in KEYS:
            vals = [(r.get(key, math.nan), name) for name, r in rows]
            finite = [(v, n) for v, n in vals if math.isfinite(v)]
            worst = (max if "gap_to_" in key else min)(finite, default=(math.nan, ""))
            out[gpus][key] = {"median": statistics.median([v for v, _ in finite])
                              if finite else math.nan,
                              "worst": worst[0], "worst_case": worst[1], "n": len(finite)}
    return out


def _fmt(key: str, v: float) -> str:
    if not math.isfinite(v):
        return "not_run"
    if key == "ref_switches":
        return f"{v:g}"
    return f"{v:.2f}%" if "gap_to_" in key else f"{v:.3f}"


def result_line(summary: dict, gpus: int, variant: str, checks: str, law_r2: float) -> str:
    """``gpus=G law=V sim_checks=P/N speedup_vs_planner=A speedup_vs_tuned_static=B
    worst_vs_tuned_static=W speedup_vs_rampup=C speedup_vs_pollux=D speedup_vs_seesaw=S
    gap_to_exact_bound=E% gap_to_relaxed_bound=E2% law_r2=Q`` (medians over the cases)."""
    s = summary[gpus]
    parts = [f"gpus={gpus}", f"law={variant}", f"sim_checks={checks}"]
    for key in (*RIVAL_KEYS, "gap_to_exact_bound", "gap_to_relaxed_bound"):
        parts.append(f"{key}={_fmt(key, s[key]['median'])}")
        if key == "speedup_vs_tuned_static":
            parts.append(f"worst_vs_tuned_static={_fmt(key, s[key]['worst'])}")
    parts.append(f"law_r2={_fmt('law_r2', law_r2)}")
    return " ".join(parts)


def worst_line(summary: dict, gpus: int, variant: str) -> str:
    """The worst case against every rival and the largest gaps, each with its case; then the
    per-interval best's median gap to the exact bound (a greedy controller's ceiling on E)."""
    s = summary[gpus]
    ref = s["ref_gap_to_exact_bound"]["median"]
    return f"[worst gpus={gpus} law={variant}] " + " ".join(
        f"{key.replace('speedup_vs_', 'vs_')}={_fmt(key, s[key]['worst'])}"
        f"({s[key]['worst_case']})" for key in (*RIVAL_KEYS, "gap_to_relaxed_bound")
        if math.isfinite(s[key]["worst"])) + (
        f" ref_gap_to_exact_bound={_fmt('ref_gap_to_exact_bound', ref)}(median: the per-interval best's)"
        if math.isfinite(ref) else "")


def world_cases(opts: SimOptions, family: str, gpus: int,
                switch_costs: tuple[float, float]) -> list[dict]:
    """Every law variant of one (family, GPU count), in ``opts.variants``' order, over one
    world (clock, candidates and the reshard planner's byte cache are shared by the variants);
    a plot per case as it finishes."""
    from megatron_cona.plot import plot_sim

    world = (vtrain_world(opts, switch_costs) if family == "gpt3-1.3b" and gpus == 8
             else predicted_world(opts, family, gpus, switch_costs))
    out = []
    for variant in opts.variants:
        case = build_case(opts, family, gpus, variant, world)
        result = run_case(case, opts.skip)
        plot_sim(result, NOTE.format(clock=result["clock"]),
                 opts.out / f"sim_{case.tag.replace('/', '_')}.png")
        out.append(result)
    return out


def _worlds(opts: SimOptions, switch_costs: tuple[float, float],
            init: Callable[[], object] | None) -> Iterator[list[dict]]:
    """Each world's cases as it finishes: in this process with one job, else in ``opts.jobs``
    spawned processes (each first calls ``init``, e.g. to register a chain), one world per
    task. A world's cases do not depend on which process ran it or on the other worlds (no
    state crosses worlds), so the report is the same whatever ``jobs`` is."""
    jobs = [(f, g) for g in opts.gpus for f in opts.families]
    if opts.jobs == 1 or len(jobs) == 1:
        for family, gpus in jobs:
            yield world_cases(opts, family, gpus, switch_costs)
        return
    # spawn, not fork: the caller may hold threads (a progress bar) and torch's thread pools
    pool = ProcessPoolExecutor(min(opts.jobs, len(jobs)), mp_context=get_context("spawn"),
                               initializer=init)
    try:
        futures = [pool.submit(world_cases, opts, f, g, switch_costs) for f, g in jobs]
        for future in as_completed(futures):
            yield future.result()
    finally:  # a failed world (or a caller that stops reading) ends the run: no world starts
        pool.shutdown(cancel_futures=True)


def run_sim(opts: SimOptions, switch_costs: tuple[float, float], progress=None,
            say: Callable[[str], None] = print, init: Callable[[], object] | None = None
            ) -> dict:
    """Checks first, then every case (worlds in parallel with ``opts.jobs`` > 1; ``init`` runs
    first in each worker process); ``sim.json`` rewritten after each world, its cases in the
    options' order whatever order the worlds finished in."""
    opts.out.mkdir(parents=True, exist_ok=True)
    checks = run_checks()
    for check in checks:
        say(check.line())
    report = {"options": {k: str(v) for k, v in asdict(opts).items() if k != "jobs"},
              "switch_costs_s": {"layout_fixed": switch_costs[0], "batch": switch_costs[1]},
              "checks": [asdict(c) for c in checks], "cases": []}
    path = opts.out / "sim.json"
    order = {f"{f}/{g}gpu/{v}": i for i, (g, f, v) in enumerate(
        (g, f, v) for g in opts.gpus for f in opts.families for v in opts.variants)}
    task = progress.add_task("cases", total=len(order)) if progress else None
    for results in _worlds(opts, switch_costs, init):
        report["cases"] = sorted(report["cases"] + results, key=lambda c: order[c["tag"]])
        path.write_text(json.dumps(report, indent=1, default=str))
        for result in results:
            say(case_line(result))
            if result["violations"]:
                raise LawError(f"{result['tag']}: a chain beat the exact bound (a bug): "
                               f"{'; '.join(result['violations'])}")
        if progress:
            progress.advance(task, len(results))
    passed = sum(c.passed for c in checks)
    report["checks_line"] = f"{passed}/{len(checks)}"
    report["summary"] = {v: summarize(report["cases"], v) for v in opts.variants}
    path.write_text(json.dumps(report, indent=1, default=str))
    return report


def case_line(case: dict) -> str:
    parts = [f"{case['tag']} [{case['clock']}]"]
    for target in case["targets"]:
        c = case["chains"]
        times = " ".join(f"{n}={c[n][target]['time_s']:.4g}s" for n in c)
        parts.append(f"  {target}: {times}; oracle switches "
                     f"{c['oracle'][target]['switches']}; CONA path "
                     f"{' > '.join(c['cona'][target]['path'][:6])}")
    return "\n".join(parts)
