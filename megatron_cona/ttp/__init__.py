"""Time-to-perplexity (TTP) evaluation: SIMULATED clock, REAL training progress.

Progress is real: small megatron-core models (a GPT-style and a Llama-style one: RoPE, SwiGLU,
GQA) train on byte-level CPython standard-library sources on the CPU ranks of this machine, and
validation loss is measured on held-out files. Time is simulated by
:class:`~megatron_cona.ttp.clock.SimulatedClock`: measured vTrain times of GPT-3 1.3B on 8x A100
for every iteration, and a switch cost from the reshard plan's bytes over NVLink plus a measured
fixed cost. CONA ranks with a predictor that never saw the rows the clock charges.

Six chains per case (model family x seed), all from the same initial weights, on the same data
order and clock; the time to reach the target validation loss (the offline planner's final
loss) is compared:

(a) ``planner``: the fastest layout at the user's global batch (what an offline planner picks),
    LR swept; its best final validation loss is the target;
(b) ``static``: the best static (layout, global batch, LR) in hindsight: for every global batch
    its fastest layout with the sqrt-scaled tuned LR, then an LR sweep around the best batch;
(c) ``rampup``: Megatron's ``--rampup-batch-size`` schedule (megatron-core's own calculator) on
    the fastest layout that admits it, ramp parameters swept, then the LR around the best;
(d) ``pollux``: batch + LR adaptation by goodput with a DP-only layout (a stand-in for Pollux:
    the same session restricted to data parallelism; Pollux itself does not run here);
(e) ``cona``: the CONA session over every candidate;
(f) ``oracle``: branch-and-measure (:func:`~megatron_cona.ttp.chains.run_oracle`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_cona.candidates import CandidateSpec, PredictorMemory, enumerate_candidates
from megatron_cona.data import VOCAB_SIZE, CorpusConfig, build_corpus
from megatron_cona.gns import GradientNoiseScale
from megatron_cona.goodput import CalibratedThroughput
from megatron_cona.lr_scaling import lr_scale
from megatron_cona.policy import DecisionLog, PolicyConfig, SwitchPolicy
from megatron_cona.session import ConaSession, SessionConfig
from megatron_cona.ttp.chains import (
    Budget,
    ChainResult,
    Driver,
    RampupDriver,
    SessionDriver,
    Trainer,
    TrainerConfig,
    TTPError,
    exec_strategy,
    run_chain,
    run_oracle,
)
from megatron_cona.ttp.clock import (
    GPT_1_3B,
    HeldOutPredictor,
    SimulatedClock,
    TableThroughput,
    VTrainTimes,
)
from predictors.spec import ParallelStrategy, TransformerSpec

CHAINS = ("planner", "static", "rampup", "pollux", "cona", "oracle")
CLOCK_NOTE = ("clock is SIMULATED ({cluster}, GPT-3 1.3B as measured by vTrain); training "
              "progress (validation loss) is REAL ({ranks} CPU ranks, small {families} models "
              "on CPython stdlib sources)")

__all__ = ["CHAINS", "GPT_1_3B", "TTPError", "TTPOptions", "exec_strategy", "run_ttp"]


@dataclass
class TTPOptions:
    out: Path = Path("out")
    families: tuple[str, ...] = ("gpt", "llama")
    seeds: tuple[int, ...] = (1234, 1235, 1236)
    target_gpus: int = 8
    target_device: str = "a100-80gb"
    user_global_batch: int = 64
    global_batch_range: tuple[int, int] = (4, 128)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    budget_samples: int = 1536  # the planner's run; its best final val loss is the target
    interval_samples: int = 128  # validation + ranking cadence, every chain
    max_time_factor: float = 2.0  # other chains stop at this multiple of the planner's TTP
    lr_sweep: tuple[float, ...] = (1e-3, 2e-3, 4e-3)  # the planner's LR sweep
    lr_multipliers: tuple[float, ...] = (0.5, 2.0)  # LR sweep around (b)'s and (c)'s best
    # Megatron ramp-up grid: (start = increment, final global batch, ramp fraction of budget)
    rampup_starts: tuple[int, ...] = (16,)
    rampup_finals: tuple[int, ...] = (64, 128)
    rampup_fractions: tuple[float, ...] = (0.25, 0.5)
    warmup_samples: int = 256
    min_lr_fraction: float = 0.1
    # the small models that really train
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2  # llama-style GQA
    seq_length: int = 64
    val_samples: int = 128
    # CONA / Pollux session
    min_gain: float = 0.05
    patience: int = 1
    switch_repeats: int = 3  # measurements of the runtime's switch costs
    skip: tuple[str, ...] = field(default_factory=tuple)  # chains to leave out (tests)


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
    runtime on these ranks: build + plan + finalize phases (the transfer is charged by bytes)."""
    from megatron_cona.runtime import TrainConfig, build_state, switch_strategy, train_step

    ranks = dist.get_world_size()
    spec = model_spec(opts, "gpt")
    corpus = build_corpus(CorpusConfig(seq_length=opts.seq_length, seed=opts.seeds[0]))
    dp = exec_strategy(2 * ranks, ranks)
    tp = ParallelStrategy(1, ranks, 1, dp.micro_batch, dp.global_batch_size)
    state = build_state(TrainConfig(spec), dp)
    train_step(state, corpus.train)  # Adam state exists, as in a running job
    fixed, batch = [], []
    for _ in range(opts.switch_repeats):
        for target in (tp, dp):
            result = switch_strategy(state, target)
            state = result.state
            fixed.append(sum(v for k, v in result.phase_seconds.items() if k != "transfer"))
        other = exec_strategy(4 * ranks, ranks)
        for target in (other, dp):
            result = switch_strategy(state, target)
            state = result.state
            batch.append(result.seconds)
    state.destroy()
    box = [statistics.median(fixed), statistics.median(batch)]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def build_clock(opts: TTPOptions) -> SimulatedClock:
    from predictors.devices import get_device

    fixed, batch = measure_switch_costs(opts)
    return SimulatedClock(VTrainTimes(GPT_1_3B, opts.target_gpus), fixed, batch,
                          get_device(opts.target_device).intra_bw)


def candidate_set(opts: TTPOptions, clock: SimulatedClock) -> list[ParallelStrategy]:
    """CONA's candidates on the target cluster that the clock has measured (vTrain), in the
    batch range, memory-filtered, and executable on the CPU ranks."""
    from predictors.devices import get_device
    from predictors.precision import get_precision

    ranks = dist.get_world_size()
    capacity = get_device(opts.target_device).memory_bytes
    spec = CandidateSpec(micro_batches=opts.micro_batches,
                         global_batch_range=opts.global_batch_range)
    found = enumerate_candidates(opts.target_gpus, GPT_1_3B, spec,
                                 precision=get_precision("fp16-mixed"),
                                 memory_model=PredictorMemory(capacity / 2**30),
                                 memory_limit_bytes=capacity)
    out = [s for s in found.kept if s in clock.measured.table and s.global_batch_size % ranks == 0]
    if not out:
        raise TTPError("global_batch_range: no candidate the clock measured")
    return out


def predictor_table(candidates: list[ParallelStrategy], opts: TTPOptions) -> dict:
    """Rank 0 trains the held-out predictor and predicts every candidate; broadcast."""
    box: list = [None]
    if dist.get_rank() == 0:
        predictor = HeldOutPredictor.train(GPT_1_3B, opts.target_gpus)
        box[0] = {"times": {s.name: predictor.iteration_time(s) for s in candidates},
                  "held_out_group": predictor.held_out_group,
                  "train_rows": predictor.train_rows,
                  "held_out_mape_pct": predictor.held_out_mape}
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------- one case


def _fastest(candidates, clock, gb: int) -> ParallelStrategy:
    return min((s for s in candidates if s.global_batch_size == gb), key=clock.iteration_time)


def _best(runs: list[ChainResult], target: float) -> ChainResult:
    return min(runs, key=lambda r: (r.time_to(target), r.final_loss))


def run_case(opts: TTPOptions, family: str, seed: int, clock: SimulatedClock,
             candidates: list[ParallelStrategy], predicted: dict, progress) -> dict:
    """The six chains for one model family and seed (collective)."""
    spec = model_spec(opts, family)
    corpus = build_corpus(CorpusConfig(seq_length=opts.seq_length, seed=seed))
    trainer = Trainer(TrainerConfig(spec, seed, opts.warmup_samples, opts.budget_samples,
                                    opts.min_lr_fraction, opts.val_samples), corpus)
    base = opts.user_global_batch
    interval = opts.interval_samples
    tag = f"{family}/s{seed}"

    def say(name: str, point) -> None:
        progress(f"{tag} {name}", point)

    planner = _fastest(candidates, clock, base)
    runs: dict[str, list[ChainResult]] = {c: [] for c in CHAINS}

    def chain(kind: str, start: ParallelStrategy, lr: float, scale: float, budget: Budget,
              driver: Driver | None = None, **settings) -> ChainResult:
        settings = {"start": start.name, "lr": lr, "lr_scale": scale, **settings}
        result = run_chain(kind, settings, trainer, clock, start, lr, scale, driver or Driver(),
                           budget, say)
        runs[kind].append(result)
        return result

    # (a) offline planner, LR swept; its best final loss is the target
    for lr in opts.lr_sweep:
        chain("planner", planner, lr, 1.0, Budget(interval, max_samples=opts.budget_samples))
    best_planner = min(runs["planner"], key=lambda r: r.final_loss)
    lr = best_planner.settings["lr"]
    target = best_planner.final_loss
    max_time = opts.max_time_factor * best_planner.time_to(target)
    budget = Budget(interval, stop_loss=target, max_time=max_time)

    # (b) best static in hindsight: every global batch on its fastest layout, sqrt-scaled LR,
    # then the LR around the best batch
    if "static" not in opts.skip:
        runs["static"].append(best_planner)
        for gb in sorted({s.global_batch_size for s in candidates} - {base}):
            chain("static", _fastest(candidates, clock, gb), lr, lr_scale("sqrt", gb, base),
                  budget)
        top = _best(runs["static"], target)
        gb = ParallelStrategy.parse(top.settings["start"]).global_batch_size
        for m in opts.lr_multipliers:
            chain("static", _fastest(candidates, clock, gb), lr * m, lr_scale("sqrt", gb, base),
                  budget)

    # (c) Megatron ramp-up on the fastest layout admitting the schedule, params then LR swept
    if "rampup" not in opts.skip:
        for start_gb in opts.rampup_starts:
            for final in opts.rampup_finals:
                for fraction in opts.rampup_fractions:
                    plan = _rampup_plan(candidates, clock, start_gb, final,
                                        int(fraction * opts.budget_samples))
                    if plan is None:
                        continue
                    chain("rampup", plan["start"], lr, lr_scale("sqrt", final, base), budget,
                          RampupDriver(**plan["driver"]), rampup=plan["flag"],
                          rampup_args=(start_gb, final, int(fraction * opts.budget_samples)))
        if not runs["rampup"]:
            raise TTPError("rampup grid: no schedule the clock can charge on one layout")
        top = _best(runs["rampup"], target)
        plan_args = top.settings["rampup_args"]
        for m in opts.lr_multipliers:
            plan = _rampup_plan(candidates, clock, *plan_args)
            chain("rampup", plan["start"], lr * m, top.settings["lr_scale"], budget,
                  RampupDriver(**plan["driver"]), rampup=plan["flag"], rampup_args=plan_args)

    # (d) Pollux-style and (e) CONA: the same session, DP-only layouts vs every candidate
    def session_factory(kind: str, cands: list[ParallelStrategy]):
        path = Path(opts.out) / f"ttp_{family}_s{seed}_{kind}_decisions.jsonl"

        def make(executor) -> ConaSession:
            return ConaSession(
                cands, CalibratedThroughput(TableThroughput(
                    {s: predicted["times"][s.name] for s in cands})),
                SwitchPolicy(PolicyConfig(min_gain=opts.min_gain, patience=opts.patience,
                                          horizon_intervals=20)),
                GradientNoiseScale(0.5, per_samples=interval),
                SessionConfig(interval=1, base_batch=base, lr_rule="sqrt"), executor,
                DecisionLog(path if dist.get_rank() == 0 else None))
        return make

    dp_only = [s for s in candidates if s.layout == (opts.target_gpus, 1, 1)]
    pollux_start = _fastest(dp_only, clock, base)
    chain("pollux", pollux_start, lr, 1.0, budget, SessionDriver(session_factory("pollux",
                                                                                  dp_only)))
    chain("cona", planner, lr, 1.0, budget, SessionDriver(session_factory("cona", candidates)))

    # (f) oracle by branch-and-measure
    if "oracle" not in opts.skip:
        runs["oracle"].append(run_oracle(trainer, clock, candidates, planner, lr, base, budget,
                                         say))

    best = {k: _best(v, target) for k, v in runs.items() if v}
    ttp = {k: r.time_to(target) for k, r in best.items()}
    return {
        "family": family, "seed": seed, "target_val_loss": target,
        "target_ppl": math.exp(target), "planner_strategy": planner.name, "lr": lr,
        "ttp_s": ttp,
        "chosen": {k: r.settings for k, r in best.items()},
        "sweeps": {k: [{"settings": r.settings, "ttp_s": r.time_to(target),
                        "final_val_loss": r.final_loss} for r in v] for k, v in runs.items()},
        "runs": {k: {"settings": r.settings, "ttp_s": ttp[k], "switches": r.switches,
                     "points": [asdict(p) for p in r.points]} for k, r in best.items()},
    }


def _rampup_plan(candidates, clock: SimulatedClock, start: int, final: int, ramp_samples: int):
    """Megatron's ramp-up ``start start ramp_samples`` to ``final`` on the fastest layout + micro
    batch (among the candidates at ``final``) whose every ramp batch the clock can charge."""
    options = []
    for s in candidates:
        if s.global_batch_size != final or (start % (s.dp * s.micro_batch)):
            continue
        steps = [ParallelStrategy(s.dp, s.tp, s.pp, s.micro_batch, gb)
                 for gb in range(start, final + 1, start)]
        if all(clock.has_time(x) for x in steps):
            options.append(s)
    if not options or (final - start) % start or start > final:
        return None
    s = min(options, key=clock.iteration_time)
    return {"start": ParallelStrategy(s.dp, s.tp, s.pp, s.micro_batch, start),
            "driver": dict(layout=s.layout, micro_batch=s.micro_batch, start=start,
                           increment=start, ramp_samples=ramp_samples, final=final),
            "flag": f"--rampup-batch-size {start} {start} {ramp_samples} --global-batch-size "
                    f"{final} on dp{s.dp}tp{s.tp}pp{s.pp}mb{s.micro_batch}"}


# ------------------------------------------------------------------------------- the run


def summarize(cases: list[dict]) -> dict:
    """Per case CONA's speedup over each baseline and its gap to the oracle; medians, spread."""
    def ratio(case, name):
        t = case["ttp_s"]
        return t[name] / t["cona"] if name in t and math.isfinite(t["cona"]) else 0.0

    metrics = {
        "speedup_vs_planner": [ratio(c, "planner") for c in cases],
        "speedup_vs_tuned_static": [ratio(c, "static") for c in cases],
        "speedup_vs_rampup": [ratio(c, "rampup") for c in cases],
        "speedup_vs_pollux": [ratio(c, "pollux") for c in cases],
        "gap_to_oracle_pct": [100.0 * (c["ttp_s"]["cona"] / c["ttp_s"]["oracle"] - 1.0)
                              if "oracle" in c["ttp_s"] else math.nan for c in cases],
    }
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
            for k, v in metrics.items()}


def run_ttp(opts: TTPOptions, progress=None) -> dict:
    """Every (family, seed) case on the current world (collective); rank 0 writes
    ``opts.out/ttp.json`` and one plot per case."""
    if opts.interval_samples % opts.global_batch_range[1]:
        raise TTPError(f"interval_samples={opts.interval_samples} must be a multiple of the "
                       f"largest global batch {opts.global_batch_range[1]}")
    ranks = dist.get_world_size()
    if opts.val_samples % (ranks * 16):
        raise TTPError(f"val_samples={opts.val_samples} must be a multiple of ranks*16")
    progress = progress or (lambda name, point: None)
    t0 = time.perf_counter()
    clock = build_clock(opts)
    candidates = candidate_set(opts, clock)
    predicted = predictor_table(candidates, opts)
    note = CLOCK_NOTE.format(cluster=f"{opts.target_gpus}x {opts.target_device} fp16",
                             ranks=ranks, families="/".join(opts.families))
    cases: list[dict] = []
    for family in opts.families:
        for seed in opts.seeds:
            cases.append(run_case(opts, family, seed, clock, candidates, predicted, progress))
            report = {
                "note": note,
                "clock": {"fixed_layout_switch_s": clock.fixed_switch_s,
                          "batch_switch_s": clock.batch_switch_s,
                          "link_bytes_per_s": clock.link_bytes_per_s,
                          "exact_lookups": clock.exact, "line_lookups": clock.interpolated,
                          "rule": "vTrain-measured time; unmeasured global batch of a measured "
                                  "layout+micro: least-squares line over micro-batches; layout "
                                  "switch = measured fixed cost + reshard-plan bytes (busiest "
                                  "rank) / NVLink"},
                "predictor": {k: v for k, v in predicted.items() if k != "times"},
                "candidates": [s.name for s in candidates],
                "cases": cases,
                "summary": summarize(cases),
                "wall_s": time.perf_counter() - t0,
                "options": {k: str(v) for k, v in asdict(opts).items()},
            }
            if dist.get_rank() == 0:  # written after every case: a cut-short run keeps its cases
                from megatron_cona.plot import plot_ttp

                out = Path(opts.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "ttp.json").write_text(json.dumps(report, indent=1, default=str))
                plot_ttp(cases[-1], note, out / f"ttp_{family}_s{seed}.png")
    return report
