"""The TTP evaluation: build (or load) the cached real curves, then run every registered chain
of every case (model family x seed x LR variant) in the stitched model on the simulated clock.

Curves (all real training, 1-rank CPU processes, ``workers`` at a time, cached by provenance):

1. per family, seed 0: the user's global batch at every LR of ``lr_grid`` (widened while the
   best is at an edge) for ``budget_samples``; the best final loss picks the base LR;
2. per family and seed: that planner curve (base LR, user batch, ``budget_samples``); its final
   validation loss is the case's target;
3. per family, seed 0: every other global batch at the sqrt-scaled base LR times
   ``lr_multipliers`` (widened at an edge), each until seed 0's target: the fewest samples to
   the target picks that batch's LR -- the per-batch LR table, shared by every chain and seed;
4. per family and seed, per LR variant (``sqrt``: base LR scaled by sqrt(batch/user batch);
   ``table``: the table): every global batch until the target (or ``max_samples_factor`` x
   budget), and Megatron's ramp-up for every (start, ramp fraction).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_cona.data import VOCAB_SIZE
from megatron_cona.lr_scaling import BatchLR, widen_sweep
from megatron_cona.policy import PolicyConfig
from megatron_cona.ttp.baselines import BASELINES, CaseInputs, bound_violations
from megatron_cona.ttp.chains import ChainResult, TTPError
from megatron_cona.ttp.clock import GPT_1_3B, SimulatedClock, VTrainTimes
from megatron_cona.ttp.curves import (
    Curve,
    CurveCache,
    cache_key,
    code_hash,
    engine_versions,
    exec_strategy,
    provenance,
)
from megatron_cona.ttp.stitch import CurveSet
from predictors.spec import ParallelStrategy, TransformerSpec

VARIANTS = ("sqrt", "table")
# ``launch(fn, world_size, *args, timeout=, threads=)``: fn(rank, world_size, *args) on
# world_size ranks, results by rank (megatron_cpu.launch.run_distributed's signature)
Launcher = Callable[..., list]
CLOCK_NOTE = ("clock is SIMULATED ({cluster}, GPT-3 1.3B as measured by vTrain); training "
              "progress (validation loss) is REAL (cached curves of small {families} models on "
              "CPython stdlib sources, 1 CPU rank each), stitched at batch changes by loss")


@dataclass
class TTPOptions:
    out: Path = Path("out/cona_ttp")
    cache: Path = Path("out/cona_curves")
    families: tuple[str, ...] = ("gpt", "llama")
    seeds: tuple[int, ...] = (1234, 1235, 1236, 1237, 1238)
    target_gpus: int = 8
    target_device: str = "a100-80gb"
    user_global_batch: int = 64
    batches: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    budget_samples: int = 4096  # the planner's run; its final val loss is the target
    max_samples_factor: float = 2.0  # other curves stop at the target or this x budget
    interval_samples: int = 128  # validation + decision cadence, every chain
    lr_grid: tuple[float, ...] = (1e-3, 2e-3, 4e-3)  # base LR sweep at the user's batch
    lr_multipliers: tuple[float, ...] = (0.5, 1.0, 2.0)  # per-batch sweep around sqrt scaling
    rampup_starts: tuple[int, ...] = (4, 16)  # Megatron ramp: start = increment
    rampup_fractions: tuple[float, ...] = (0.03, 0.1)  # ramp samples / budget
    warmup_samples: int = 256
    min_lr_fraction: float = 0.1
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2  # llama-style GQA
    seq_length: int = 64
    val_samples: int = 128
    # CONA's session (Pollux's too)
    min_gain: float = 0.01
    patience: int = 1
    cooldown: int = 0
    noise_z: float = 1.0
    switch_repeats: int = 3
    bound_snap: float = 1e-3  # optimistic rounding of the entry loss (keeps it a bound)
    workers: int = 2
    fresh: bool = False
    check_exact: bool = True
    build_only: bool = False  # build the curve cache, run no case
    variants: tuple[str, ...] = VARIANTS
    skip: tuple[str, ...] = field(default_factory=tuple)  # chains to leave out


def model_spec(opts: TTPOptions, family: str) -> TransformerSpec:
    if family == "gpt":
        return TransformerSpec("gpt", opts.num_layers, opts.hidden_size, opts.num_attention_heads,
                               opts.seq_length, VOCAB_SIZE)
    if family == "llama":
        return TransformerSpec("llama", opts.num_layers, opts.hidden_size,
                               opts.num_attention_heads, opts.seq_length, VOCAB_SIZE,
                               num_query_groups=opts.num_query_groups, swiglu=True,
                               tied_embeddings=False)
    raise TTPError(f"families: {family!r} is not 'gpt' or 'llama'")


# ------------------------------------------------------------------------------ the clock


def measure_switch_costs(opts: TTPOptions) -> tuple[float, float]:
    """Median seconds of (fixed part of a layout switch, a batch-only switch) of the real CONA
    runtime on these ranks (collective): build + plan + finalize phases."""
    import torch.distributed as dist

    from megatron_cona.data import CorpusConfig, build_corpus
    from megatron_cona.runtime import TrainConfig, build_state, switch_strategy, train_step

    ranks = dist.get_world_size()
    corpus = build_corpus(CorpusConfig(seq_length=opts.seq_length, seed=opts.seeds[0]))
    dp = exec_strategy(2 * ranks, ranks)
    tp = ParallelStrategy(1, ranks, 1, dp.micro_batch, dp.global_batch_size)
    state = build_state(TrainConfig(model_spec(opts, "gpt")), dp)
    train_step(state, corpus.train)  # Adam state exists, as in a running job
    fixed, batch = [], []
    for _ in range(opts.switch_repeats):
        for target in (tp, dp):
            result = switch_strategy(state, target)
            state = result.state
            fixed.append(sum(v for k, v in result.phase_seconds.items() if k != "transfer"))
        for target in (exec_strategy(4 * ranks, ranks), dp):
            result = switch_strategy(state, target)
            state = result.state
            batch.append(result.seconds)
    state.destroy()
    box = [statistics.median(fixed), statistics.median(batch)]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def _switch_worker(rank: int, world: int, opts: TTPOptions) -> tuple[float, float]:
    return measure_switch_costs(opts)


def build_clock(opts: TTPOptions, launch: Launcher) -> SimulatedClock:
    from predictors.devices import get_device

    fixed, batch = launch(_switch_worker, 2, opts, timeout=600, threads=1)[0]
    return SimulatedClock(VTrainTimes(GPT_1_3B, opts.target_gpus), fixed, batch,
                          get_device(opts.target_device).intra_bw)


def candidate_set(opts: TTPOptions, clock: SimulatedClock) -> list[ParallelStrategy]:
    """CONA's candidates on the target cluster that the clock has measured (vTrain), at the
    curves' global batches, memory-filtered."""
    from megatron_cona.candidates import CandidateSpec, PredictorMemory, enumerate_candidates
    from predictors.devices import get_device
    from predictors.spec.precision import get_precision

    capacity = get_device(opts.target_device).memory_bytes
    spec = CandidateSpec(micro_batches=opts.micro_batches,
                         global_batch_range=(min(opts.batches), max(opts.batches)))
    found = enumerate_candidates(opts.target_gpus, GPT_1_3B, spec,
                                 precision=get_precision("fp16-mixed"),
                                 memory_model=PredictorMemory(capacity / 2**30),
                                 memory_limit_bytes=capacity)
    out = [s for s in found.kept if s in clock.measured.table
           and s.global_batch_size in opts.batches]
    if not out:
        raise TTPError("batches: no candidate the clock measured")
    return out


# ------------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class CurveJob:
    family: str
    seed: int
    batch: int
    lr_rule: BatchLR
    max_samples: int
    stop_loss: float | None = None
    ramp: tuple[int, int, int] | None = None  # Megatron (start, increment, samples)


class CurveBuilder:
    """Loads cached curves and trains the missing ones, ``workers`` 1-rank processes at a
    time; each curve is written to the cache as soon as it exists."""

    def __init__(self, opts: TTPOptions, launch: Launcher, progress=None) -> None:
        self.opts, self.launch = opts, launch
        self.cache = CurveCache(opts.cache)
        self.code = code_hash()
        self.engines = engine_versions()
        self.progress = progress or (lambda msg: None)
        self.trained: list[str] = []
        self.loaded = 0

    def provenance(self, job: CurveJob) -> dict:
        o = self.opts
        schedule = {"warmup_samples": o.warmup_samples, "decay_samples": o.budget_samples,
                    "min_lr_fraction": o.min_lr_fraction, "interval": o.interval_samples,
                    "val_samples": o.val_samples, "max_samples": job.max_samples,
                    "stop_loss": job.stop_loss, "lr_rule": asdict(job.lr_rule)}
        ramp = ({"start": job.ramp[0], "increment": job.ramp[1], "samples": job.ramp[2]}
                if job.ramp else None)
        return provenance(code=self.code, engines=self.engines,
                          model=model_spec(o, job.family), seed=job.seed, schedule=schedule,
                          batch=job.batch, lr=job.lr_rule.lr(job.batch), ramp=ramp, ranks=1)

    def ensure(self, jobs: list[CurveJob]) -> dict[CurveJob, Curve]:
        out: dict[CurveJob, Curve] = {}
        missing = []
        for job in dict.fromkeys(jobs):
            curve = None if self.opts.fresh and cache_key(self.provenance(job)) not in \
                self.trained else self.cache.get(self.provenance(job))
            if curve is None:
                missing.append(job)
            else:
                out[job] = curve
                self.loaded += 1
        if missing:
            self.progress(f"training {len(missing)} curve(s) on {self.opts.workers} worker(s)")
            shares = [missing[i::self.opts.workers] for i in range(self.opts.workers)]
            errors: list[BaseException] = []

            def run(share):
                try:
                    self.launch(_curve_worker, 1, self.opts, share,
                                [self.provenance(j) for j in share], timeout=6 * 3600)
                except BaseException as err:  # noqa: BLE001 - re-raised below
                    errors.append(err)
            threads = [threading.Thread(target=run, args=(s,)) for s in shares if s]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            for job in missing:
                curve = self.cache.get(self.provenance(job))
                if curve is None:
                    raise TTPError(f"curve {job} was not written")
                self.trained.append(curve.key)
                out[job] = curve
        return out

    def retrain(self, job: CurveJob) -> Curve:
        """Train ``job`` again without touching the cache (the bit-exact check)."""
        return self.launch(_curve_worker, 1, self.opts, [job], [self.provenance(job)], False,
                           timeout=3600)[0][0]


def _curve_worker(rank: int, world: int, opts: TTPOptions, jobs: list[CurveJob],
                  provs: list[dict], write: bool = True) -> list[Curve]:
    from megatron_cona.data import CorpusConfig, build_corpus
    from megatron_cona.ttp.curves import Trainer, TrainerConfig, train_curve

    cache, corpora, out = CurveCache(opts.cache), {}, []
    for job, prov in zip(jobs, provs, strict=True):
        if job.seed not in corpora:
            corpora[job.seed] = build_corpus(CorpusConfig(seq_length=opts.seq_length,
                                                          seed=job.seed))
        trainer = Trainer(TrainerConfig(model_spec(opts, job.family), job.seed,
                                        opts.warmup_samples, opts.budget_samples,
                                        opts.min_lr_fraction, opts.val_samples),
                          corpora[job.seed])
        t0 = time.time()
        curve = train_curve(trainer, prov, job.lr_rule, opts.interval_samples, job.max_samples,
                            job.stop_loss)
        print(f"curve {job.family}/s{job.seed} gb{job.batch} lr {prov['lr']:.2e}"
              f"{' ramp ' + str(job.ramp) if job.ramp else ''}: {curve.samples[-1]} samples, "
              f"val {curve.val_loss[-1]:.4f}, {time.time() - t0:.0f}s", flush=True)
        if write:
            cache.put(curve)
        out.append(curve)
    return out


def samples_to(curve: Curve, target: float) -> float:
    for k in range(1, len(curve.val_loss)):
        if curve.val_loss[k] <= target:
            a, b = curve.val_loss[k - 1], curve.val_loss[k]
            frac = 1.0 if a <= target else (a - target) / (a - b)
            return curve.samples[k - 1] + frac * (curve.samples[k] - curve.samples[k - 1])
    return math.inf


@dataclass
class FamilyCurves:
    base_lr: float
    sweeps: dict  # batch -> {lr: score}
    table: dict[int, float]
    targets: dict[int, float]  # seed -> target val loss
    curves: dict  # variant -> seed -> batch -> Curve
    ramps: dict  # variant -> seed -> flag -> Curve


def build_family(opts: TTPOptions, family: str, builder: CurveBuilder) -> FamilyCurves:
    o, user, seed0 = opts, opts.user_global_batch, opts.seeds[0]
    full = o.budget_samples
    cap = int(o.max_samples_factor * o.budget_samples)

    def planner_job(lr: float, seed: int) -> CurveJob:
        return CurveJob(family, seed, user, BatchLR(lr, user), full)

    # 1. base LR: the user's batch at every LR of the grid, widened at an edge
    def final_loss(lr: float) -> float:
        return builder.ensure([planner_job(lr, seed0)])[planner_job(lr, seed0)].val_loss[-1]
    builder.ensure([planner_job(lr, seed0) for lr in o.lr_grid])
    base_lr, base_scores = widen_sweep(final_loss, list(o.lr_grid))
    # 2. the planner curve of every seed: its final loss is the target
    planners = builder.ensure([planner_job(base_lr, s) for s in o.seeds])
    targets = {s: planners[planner_job(base_lr, s)].val_loss[-1] for s in o.seeds}
    sqrt_rule = BatchLR(base_lr, user)
    # 3. per-batch LR table from one sweep on seed 0 (time to seed 0's target)
    sweeps, table = {user: base_scores}, {user: base_lr}

    def batch_job(b: int, lr: float, seed: int) -> CurveJob:
        return CurveJob(family, seed, b, BatchLR(lr, b), cap, targets[seed])
    others = [b for b in o.batches if b != user]
    grids = {b: [sqrt_rule.lr(b) * m for m in o.lr_multipliers] for b in others}
    builder.ensure([batch_job(b, lr, seed0) for b in others for lr in grids[b]])  # one spawn
    for b in others:
        grid = grids[b]

        def score(lr: float, b=b) -> float:
            curve = builder.ensure([batch_job(b, lr, seed0)])[batch_job(b, lr, seed0)]
            to = samples_to(curve, targets[seed0])
            return to if math.isfinite(to) else cap + curve.val_loss[-1]
        table[b], sweeps[b] = widen_sweep(score, grid)
    rules = {"sqrt": sqrt_rule, "table": BatchLR.from_table(table, user)}
    # 4. every batch and ramp of every seed under each LR variant
    curves: dict = {v: {} for v in o.variants}
    ramps: dict = {v: {} for v in o.variants}
    plan = {}
    for v in o.variants:
        rule = rules[v]
        for s in o.seeds:
            jobs = {b: (planner_job(base_lr, s) if b == user
                        else CurveJob(family, s, b, _rule_at(rule, b), cap, targets[s]))
                    for b in o.batches}
            ramp_jobs = {}
            for start in o.rampup_starts:
                for frac in o.rampup_fractions:
                    samples = int(frac * o.budget_samples)
                    flag = f"--rampup-batch-size {start} {start} {samples}"
                    ramp_jobs[flag] = CurveJob(family, s, user, rule, cap, targets[s],
                                               (start, start, samples))
            plan[v, s] = (jobs, ramp_jobs)
    got = builder.ensure([j for jobs, ramp_jobs in plan.values()  # one spawn for all
                          for j in (*jobs.values(), *ramp_jobs.values())])
    for (v, s), (jobs, ramp_jobs) in plan.items():
        curves[v][s] = {b: got[j] for b, j in jobs.items()}
        ramps[v][s] = {f: got[j] for f, j in ramp_jobs.items()}
    return FamilyCurves(base_lr, {b: {str(k): x for k, x in v.items()} for b, v in
                                  sweeps.items()}, table, targets, curves, ramps)


def _rule_at(rule: BatchLR, batch: int) -> BatchLR:
    """A static curve at ``batch`` under ``rule``: its LR is the rule's LR at that batch."""
    return BatchLR(rule.lr(batch), batch)


# -------------------------------------------------------------------------------- cases


def run_case(opts: TTPOptions, tag: str, fam: FamilyCurves, variant: str, seed: int,
             clock: SimulatedClock, candidates: list[ParallelStrategy],
             predicted: dict[ParallelStrategy, float]) -> dict:
    user = opts.user_global_batch
    rule = BatchLR(fam.base_lr, user) if variant == "sqrt" else \
        BatchLR.from_table(fam.table, user)
    target = fam.targets[seed]
    curves = CurveSet(fam.curves[variant][seed], opts.interval_samples)
    planner = min((s for s in candidates if s.global_batch_size == user),
                  key=clock.iteration_time)
    planner_time = _static_time(curves, clock, planner, target)
    case = CaseInputs(tag, curves, fam.ramps[variant][seed], clock, candidates, predicted,
                      rule, user, target, opts.max_samples_factor * 4 * planner_time,
                      opts.interval_samples,
                      PolicyConfig(min_gain=opts.min_gain, patience=opts.patience,
                                   cooldown=opts.cooldown, horizon_intervals=20),
                      opts.noise_z, Path(opts.out), opts.bound_snap)
    results: dict[str, ChainResult] = {}
    for name, baseline in BASELINES.items():
        if name in opts.skip:
            continue
        result = baseline.run(case)
        if result is not None:
            results[name] = result
    ttp = {k: r.time_to(target) for k, r in results.items()}
    violations = bound_violations(results, target) if "bound" in results else []
    return {"tag": tag, "variant": variant, "seed": seed, "target_val_loss": target,
            "target_ppl": math.exp(target), "planner_strategy": planner.name,
            "lr_rule": rule.name, "lr_table": {str(b): rule.lr(b) for b in curves.batches},
            "ttp_s": ttp, "bound_violations": violations,
            "runs": {k: {"settings": r.settings, "ttp_s": ttp[k], "switches": r.switches,
                         "points": [asdict(p) for p in r.points]} for k, r in results.items()}}


def _static_time(curves: CurveSet, clock: SimulatedClock, s: ParallelStrategy,
                 target: float) -> float:
    track = curves.tracks[s.global_batch_size]
    to = track.position(target)
    end = track.end if to is None else to
    return end / s.global_batch_size * clock.iteration_time(s)


def summarize(cases: list[dict]) -> dict:
    """Per variant: medians (min, max) over cases of the reference's (the bound's) speedup over
    the best static strategy and its switches, CONA's speedup over every rival, CONA's gap to
    the bound."""
    out = {}
    for variant in sorted({c["variant"] for c in cases}):
        mine = [c for c in cases if c["variant"] == variant]
        metrics: dict[str, list[float]] = {
            "ref_vs_best_static": [c["ttp_s"].get("static", math.nan) / c["ttp_s"]["bound"]
                                   for c in mine],
            "ref_switches": [float(len(c["runs"]["bound"]["switches"])) for c in mine],
        }
        for name, b in BASELINES.items():
            if b.rival:
                metrics[f"speedup_vs_{'tuned_static' if name == 'static' else name}"] = [
                    c["ttp_s"].get(name, math.nan) / c["ttp_s"]["cona"] for c in mine]
        metrics["gap_to_bound_pct"] = [100.0 * (c["ttp_s"]["cona"] / c["ttp_s"]["bound"] - 1)
                                       for c in mine]
        out[variant] = {k: _stats(v) for k, v in metrics.items()}
    return out


def _stats(values: list[float]) -> dict:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "values": values}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite),
            "values": values}


def result_line(summary: dict, variant: str) -> str:
    s = summary[variant]
    names = [f"speedup_vs_{'tuned_static' if n == 'static' else n}" for n, b in
             BASELINES.items() if b.rival]
    for extra in ("speedup_vs_pollux",):  # always in the line; nan when not registered
        if extra not in names:
            names.append(extra)
    order = ["speedup_vs_planner", "speedup_vs_tuned_static", "speedup_vs_rampup",
             "speedup_vs_pollux"]
    parts = [f"ref_vs_best_static={s['ref_vs_best_static']['median']:.2f}",
             f"ref_switches={s['ref_switches']['median']:.0f}"]
    for n in order + [n for n in names if n not in order]:
        parts.append(f"{n}={s.get(n, {'median': math.nan})['median']:.2f}")
    parts.append(f"gap_to_bound={s['gap_to_bound_pct']['median']:.1f}%")
    return " ".join(parts)


def run_ttp(opts: TTPOptions, launch: Launcher, progress=None) -> dict:
    """Build/load the curves, run every case, write ``out/ttp.json`` (after every case) and
    one plot per case; raise :class:`TTPError` when a chain beats the bound. ``launch`` starts
    the training and switch-measuring processes (the repository's CPU launcher,
    ``megatron_cpu.launch.run_distributed``, which the plugin does not ship)."""
    from megatron_cona.plot import plot_ttp
    from megatron_cona.ttp.clock import HeldOutPredictor

    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = build_clock(opts, launch)
    say(f"switch costs: layout fixed {clock.fixed_switch_s:.3f}s, batch {clock.batch_switch_s:.4f}s")
    candidates = candidate_set(opts, clock)
    predictor = HeldOutPredictor.train(GPT_1_3B, opts.target_gpus)
    predicted = {s: predictor.iteration_time(s) for s in candidates}
    builder = CurveBuilder(opts, launch, say)
    families = {f: build_family(opts, f, builder) for f in opts.families}
    if opts.build_only:
        return {"curves": {"cache": str(opts.cache), "loaded": builder.loaded,
                           "trained": len(builder.trained)}}
    exact = None
    if opts.check_exact:  # one cached curve trained again must match bit for bit
        job = CurveJob(opts.families[0], opts.seeds[0], opts.user_global_batch,
                       BatchLR(families[opts.families[0]].base_lr, opts.user_global_batch),
                       opts.budget_samples)
        cached = builder.ensure([job])[job]
        again = builder.retrain(job)
        exact = {"curve": cached.key, "bit_exact": cached.same_numbers(again),
                 "retrain_s": again.wall_s}
        say(f"re-trained cached curve {cached.key}: bit-exact {exact['bit_exact']}")
    note = CLOCK_NOTE.format(cluster=f"{opts.target_gpus}x {opts.target_device} fp16",
                             families="/".join(opts.families))
    cases: list[dict] = []
    report: dict = {}
    for family, fam in families.items():
        for seed in opts.seeds:
            for variant in opts.variants:
                tag = f"{family}/s{seed}/{variant}"
                case = run_case(opts, tag, fam, variant, seed, clock, candidates, predicted)
                case["family"] = family
                cases.append(case)
                say(f"{tag}: " + "  ".join(f"{k} {v:.2f}s" for k, v in case["ttp_s"].items()))
                report = {
                    "note": note,
                    "clock": {"fixed_layout_switch_s": clock.fixed_switch_s,
                              "batch_switch_s": clock.batch_switch_s,
                              "link_bytes_per_s": clock.link_bytes_per_s,
                              "exact_lookups": clock.exact, "line_lookups": clock.interpolated},
                    "predictor": {"held_out_group": predictor.held_out_group,
                                  "train_rows": predictor.train_rows,
                                  "held_out_mape_pct": predictor.held_out_mape},
                    "curves": {"cache": str(opts.cache), "code": builder.code,
                               "engines": builder.engines, "loaded": builder.loaded,
                               "trained": len(builder.trained), "bit_exact_check": exact},
                    "families": {f: {"base_lr": x.base_lr, "lr_table": x.table,
                                     "sweeps": x.sweeps, "targets": x.targets}
                                 for f, x in families.items()},
                    "baselines": {n: b.doc for n, b in BASELINES.items()},
                    "candidates": [s.name for s in candidates],
                    "cases": cases, "summary": summarize(cases),
                    "wall_s": time.perf_counter() - t0,
                    "options": {k: str(v) for k, v in asdict(opts).items()},
                }
                (out / "ttp.json").write_text(json.dumps(report, indent=1, default=str))
                plot_ttp(case, note, out / f"ttp_{tag.replace('/', '_')}.png")
    if exact is not None and not exact["bit_exact"]:
        raise TTPError(f"cached curve {exact['curve']} did not re-train bit-exactly: the cache "
                       "is stale or training is not deterministic; rerun with --fresh")
    bad = [f"{c['tag']}: {v}" for c in cases for v in c["bound_violations"]]
    if bad:
        raise TTPError("a chain beat the DP bound (a bug in the bound or the chain): "
                       + "; ".join(bad))
    return report
