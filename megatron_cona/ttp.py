"""Time-to-perplexity (TTP) evaluation with a SIMULATED clock and REAL training progress.

Progress is real: a small GPT (megatron-core GPTModel) trains on byte-level CPython
standard-library sources on the CPU ranks of this machine, and validation loss is measured on
held-out files. Time is simulated: every iteration is charged what the same strategy and global
batch cost for a target model on a target cluster (default: a GPT-3 1.3B-sized model, fp16, on
8x A100 80GB) -- the measured vTrain iteration time where that configuration was measured, the
time predictor otherwise (by default only measured candidates are used, so the clock is pure
ground truth) -- and every switch its modelled cost. Three chains are compared:

(a) static: the single strategy with the minimum iteration time for the user's global batch
    (what an offline planner picks), for the whole run;
(b) CONA: starts there, then ranks candidates by goodput (times from the time predictor,
    calibrated by the simulated measurements of strategies run; gradient noise scale from the
    live run) and switches under the hysteresis/payback policy;
(c) oracle: at every interval the candidate with the best hindsight goodput -- exact
    simulated times of every candidate and the noise scale the other runs measured at the same
    validation loss -- switching whenever that repays its cost within the interval.

The batch size changes the math of the small model (so progress is real); the (DP, TP, PP)
layout does not, so all chains execute on the CPU ranks as pure data parallelism with the
chosen global batch, and the layout only sets the simulated time.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_cona.candidates import CandidateSpec, PredictorMemory, enumerate_candidates
from megatron_cona.controller import ConaController, ControllerConfig, gradient_sample
from megatron_cona.data import VOCAB_SIZE, CorpusConfig, build_corpus
from megatron_cona.gns import GradientNoiseScale, unbiased_estimates
from megatron_cona.goodput import CalibratedThroughput, PredictorThroughput, estimate
from megatron_cona.lr_scaling import lr_scale
from megatron_cona.policy import DecisionLog, PolicyConfig, SwitchCostModel, SwitchPolicy
from predictors.spec import ParallelStrategy, TransformerSpec
from predictors.vtrain import data_path as vtrain_data_path

log = logging.getLogger("megatron_cona.ttp")

GPT_1_3B = TransformerSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                           seq_length=1024, vocab_size=51200)
# The vTrain measurements ship with the predictors (MIT licence beside them).
VTRAIN_CSV = vtrain_data_path()
CLOCK_NOTE = ("clock is SIMULATED ({cluster}, {model}); training progress (loss, validation "
              "perplexity) is REAL ({ranks} CPU ranks, tiny GPT on CPython stdlib sources)")


class TTPError(ValueError):
    """A TTP setting that cannot run (names the option)."""


@dataclass
class TTPOptions:
    out: Path = Path("out")
    target_gpus: int = 8
    target_device: str = "a100-80gb"
    target_precision: str = "fp16-mixed"
    vtrain_csv: Path | None = VTRAIN_CSV  # measured A100 times; None: predictor only
    measured_only: bool = True  # with vTrain data: only candidates the clock has measured
    static_global_batch: int = 64
    global_batch_range: tuple[int, int] = (4, 128)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    static_samples: int = 12288  # the static run's length; its final loss is the target
    interval_samples: int = 256  # validation + ranking cadence (same for every chain)
    max_time_factor: float = 2.0  # CONA/oracle stop at this multiple of static's time
    lr: float = 2e-3
    lr_sweep: tuple[float, ...] = ()  # tune the static baseline's LR over these first
    warmup_samples: int = 512
    min_lr_fraction: float = 0.1
    seed: int = 1234
    # the small model that really trains
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    val_samples: int = 128
    min_gain: float = 0.05
    patience: int = 1
    layout_switch_s: float = 2.0  # rebuild groups/DDP/optimizer on the target cluster
    link_bytes_per_s: float = 100e9  # per-GPU NVLink bandwidth for the moved state


# --------------------------------------------------------------------------- simulated cluster


class VTrainTimes:
    """Measured Megatron iteration times on A100s (vTrain ground truth), exact lookups."""

    def __init__(self, path: Path, model: TransformerSpec, gpus: int) -> None:
        self.table: dict[tuple[int, int, int, int, int], float] = {}
        with open(path, encoding="utf-8-sig") as fh:
            for row in csv.reader(fh):
                if not row or row[0].startswith("#"):
                    continue
                g, gb, mb, h, heads, layers, seq, tp, dp, pp, ms = row
                if (int(g), int(h), int(heads), int(layers), int(seq)) == (
                        gpus, model.hidden_size, model.num_attention_heads, model.num_layers,
                        model.seq_length):
                    self.table[(int(dp), int(tp), int(pp), int(mb), int(gb))] = float(ms) / 1e3

    def get(self, s: ParallelStrategy) -> float | None:
        return self.table.get((s.dp, s.tp, s.pp, s.micro_batch, s.global_batch_size))


@dataclass
class SimulatedCluster:
    """The simulated clock: measured time where vTrain has it, the time predictor otherwise."""

    model: TransformerSpec
    predictor: PredictorThroughput
    measured: VTrainTimes | None
    layout_switch_s: float
    link_bytes_per_s: float
    hits: int = 0
    misses: int = 0

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        seconds = self.measured.get(strategy) if self.measured else None
        if seconds is not None:
            self.hits += 1
            return seconds
        self.misses += 1
        return self.predictor.iteration_time(strategy)

    def switch_time(self, old: ParallelStrategy, new: ParallelStrategy) -> float:
        if old.layout == new.layout:
            return 0.05 if old != new else 0.0  # micro-batch calculator + data position
        # fp16 weights + fp32 main weights + two Adam moments, spread over the GPUs
        state_bytes = self.model.num_parameters() * (2 + 4 + 4 + 4)
        return self.layout_switch_s + state_bytes / old.world_size / self.link_bytes_per_s


# --------------------------------------------------------------------------- runs


@dataclass
class Point:
    samples: int
    sim_time: float
    val_loss: float
    train_loss: float
    strategy: str
    noise_scale: float  # this interval's raw (un-smoothed) estimate


@dataclass
class ChainResult:
    name: str
    points: list[Point] = field(default_factory=list)
    switches: list[dict] = field(default_factory=list)
    ttp: float = math.inf

    def time_to(self, target: float) -> float:
        return next((p.sim_time for p in self.points if p.val_loss <= target), math.inf)


class _IntervalNoise:
    """Ratio of the interval's summed unbiased tr(S) and |G|^2 estimates (no smoothing)."""

    def __init__(self) -> None:
        self.tr = self.g2 = 0.0

    def add(self, stats) -> None:
        sample = gradient_sample(stats)
        if sample is None:
            return
        small = sum(sample.small_sq) / len(sample.small_sq)
        g2, tr = unbiased_estimates(small, sample.big_sq, sample.small_batch, sample.big_batch)
        self.g2, self.tr = self.g2 + g2, self.tr + tr

    def value(self) -> float:
        return max(self.tr, 0.0) / self.g2 if self.g2 > 0 else math.nan


class HindsightNoise:
    """Noise scale as a function of validation loss, from what the other chains measured."""

    def __init__(self, points: list[Point]) -> None:
        self.points = sorted((p.val_loss, p.noise_scale) for p in points
                             if math.isfinite(p.noise_scale))

    def at(self, val_loss: float, k: int = 3) -> float:
        if not self.points:
            return math.nan
        near = sorted(self.points, key=lambda x: abs(x[0] - val_loss))[:k]
        values = sorted(v for _, v in near)
        return values[len(values) // 2]


EXEC_MAX_MICRO = 16


def exec_strategy(global_batch: int, ranks: int, max_micro: int = EXEC_MAX_MICRO
                  ) -> ParallelStrategy:
    """How a target global batch runs on the CPU ranks: data parallel, few micro-batches."""
    if global_batch % ranks:
        raise TTPError(f"global batch {global_batch} is not divisible by ranks={ranks}")
    local = global_batch // ranks
    micro = max(d for d in range(1, min(local, max_micro) + 1) if local % d == 0)
    return ParallelStrategy(ranks, 1, 1, micro, global_batch)


class _Trainer:
    """The real small-model training shared by the three chains (one per chain)."""

    def __init__(self, opts: TTPOptions, corpus, base_batch: int, lr: float) -> None:
        from megatron_cona import runtime

        self.rt = runtime
        self.opts = opts
        self.corpus = corpus
        self.ranks = dist.get_world_size()
        self.base_batch = base_batch
        spec = TransformerSpec("gpt", opts.num_layers, opts.hidden_size,
                               opts.num_attention_heads, opts.seq_length, VOCAB_SIZE)
        self.cfg = runtime.TrainConfig(
            model=spec, lr=lr, min_lr=lr * opts.min_lr_fraction,
            lr_warmup_samples=opts.warmup_samples, lr_decay_samples=opts.static_samples,
            lr_decay_style="cosine", adam_beta2=0.99, seed=opts.seed)

    def start(self, global_batch: int):
        self.state = self.rt.build_state(self.cfg, exec_strategy(global_batch, self.ranks))
        self._set_lr(global_batch)

    def _set_lr(self, global_batch: int) -> None:
        scale = lr_scale("sqrt", global_batch, self.base_batch)
        self.state.scheduler.max_lr = self.cfg.lr * scale
        self.state.scheduler.min_lr = self.cfg.min_lr * scale
        self.state.scheduler.step(increment=0)

    def set_batch(self, global_batch: int) -> None:
        from megatron_cona.reshard.switch import switch_strategy

        target = exec_strategy(global_batch, self.ranks)
        if target != self.state.strategy:
            result = switch_strategy(self.state, target)
            if not result.switched:
                raise RuntimeError(f"switch to {target.name} failed: {result.error}")
            self.state = result.state
        self._set_lr(global_batch)

    def step(self):
        return self.rt.train_step(self.state, self.corpus.train, grad_stats=True)

    def val_loss(self) -> float:
        return self.rt.evaluate(self.state, self.corpus.valid, 0, self.opts.val_samples)

    def close(self) -> None:
        self.state.destroy()


def _run_chain(name: str, opts: TTPOptions, trainer: _Trainer, clock: SimulatedCluster,
               start: ParallelStrategy, choose, stop_loss: float | None,
               max_time: float | None, max_samples: int | None, progress) -> ChainResult:
    """Train from the same initial state with ``choose(point, current) -> strategy`` called at
    every interval (``None``: keep); stop at the target loss, time or sample cap."""
    result = ChainResult(name)
    current = start
    trainer.start(current.global_batch_size)
    sim_time, samples, next_eval = 0.0, 0, opts.interval_samples
    noise = _IntervalNoise()
    losses: list[float] = []
    while True:
        step = trainer.step()
        if not math.isfinite(step.loss):
            raise RuntimeError(f"{name}: loss={step.loss} at {samples} samples")
        seconds = clock.iteration_time(current)
        sim_time += seconds
        samples += current.global_batch_size
        losses.append(step.loss)
        noise.add(step.grad_stats)
        if choose is not None and hasattr(choose, "observe"):
            choose.observe(current, seconds, step.grad_stats)
        if samples < next_eval:
            continue
        next_eval += opts.interval_samples
        point = Point(samples, sim_time, trainer.val_loss(), sum(losses) / len(losses),
                      current.name, noise.value())
        result.points.append(point)
        losses, noise = [], _IntervalNoise()
        progress(name, point)
        if stop_loss is not None and point.val_loss <= stop_loss:
            break
        if max_time is not None and sim_time >= max_time:
            break
        if max_samples is not None and samples >= max_samples:
            break
        target = choose(point, current) if choose is not None else None
        if target is not None and target != current:
            cost = clock.switch_time(current, target)
            sim_time += cost
            if hasattr(choose, "record_switch"):
                choose.record_switch(current, target, cost)
            result.switches.append({"samples": samples, "sim_time": sim_time, "from": current.name,
                                    "to": target.name, "cost_s": cost})
            if target.global_batch_size != current.global_batch_size:
                trainer.set_batch(target.global_batch_size)
            current = target
    trainer.close()
    return result


class _ConaChooser:
    def __init__(self, controller: ConaController) -> None:
        self.c = controller

    def observe(self, strategy, seconds, stats) -> None:
        self.c.observe(strategy, seconds, stats)

    def __call__(self, point: Point, current: ParallelStrategy) -> ParallelStrategy:
        return self.c.decide(point.samples, current, sim_time=point.sim_time,
                             val_loss=point.val_loss).target

    def record_switch(self, old, new, cost) -> None:
        self.c.record_switch(0, old, new, cost)


class _OracleChooser:
    def __init__(self, candidates, clock: SimulatedCluster, hindsight: HindsightNoise,
                 base_batch: int, interval_samples: int) -> None:
        self.candidates, self.clock, self.hindsight = candidates, clock, hindsight
        self.base_batch, self.interval_samples = base_batch, interval_samples
        self.times = {s: clock.iteration_time(s) for s in candidates}

    def __call__(self, point: Point, current: ParallelStrategy) -> ParallelStrategy:
        phi = self.hindsight.at(point.val_loss)
        best = max((estimate(s, t, phi, self.base_batch) for s, t in self.times.items()),
                   key=lambda e: e.goodput)
        cur = estimate(current, self.clock.iteration_time(current), phi, self.base_batch)
        # switch when the goodput gain over the next interval pays for the switch
        interval_s = self.interval_samples / cur.throughput
        gain_s = (best.goodput / cur.goodput - 1.0) * interval_s
        return best.strategy if gain_s > self.clock.switch_time(current, best.strategy) else current


def run_ttp(opts: TTPOptions, progress=None) -> dict:
    """The three chains on the current world (collective); rank 0 writes ``opts.out``."""
    from predictors.precision import get_precision

    get_precision(opts.target_precision)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    lo, hi = opts.global_batch_range
    if opts.val_samples % (ranks * EXEC_MAX_MICRO):
        raise TTPError(f"val_samples={opts.val_samples} must be a multiple of ranks*"
                       f"{EXEC_MAX_MICRO}={ranks * EXEC_MAX_MICRO} (evaluation runs in whole "
                       "micro-batches of every executed strategy)")
    if not lo <= opts.static_global_batch <= hi:
        raise TTPError(f"static_global_batch={opts.static_global_batch} outside "
                       f"global_batch_range={opts.global_batch_range}")
    predictor = PredictorThroughput(GPT_1_3B, opts.target_precision, opts.target_device)
    vtrain = None
    if opts.vtrain_csv is not None and Path(opts.vtrain_csv).exists():
        vtrain = VTrainTimes(Path(opts.vtrain_csv), GPT_1_3B, opts.target_gpus)
    clock = SimulatedCluster(GPT_1_3B, predictor, vtrain, opts.layout_switch_s,
                             opts.link_bytes_per_s)
    spec = CandidateSpec(micro_batches=opts.micro_batches, global_batch_range=(lo, hi))
    from predictors.devices import get_device

    capacity = get_device(opts.target_device).memory_bytes
    found = enumerate_candidates(opts.target_gpus, GPT_1_3B, spec,
                                 precision=get_precision(opts.target_precision),
                                 memory_model=PredictorMemory(capacity / 2**30),
                                 memory_limit_bytes=capacity)
    candidates = [s for s in found.kept if s.global_batch_size % ranks == 0
                  and (vtrain is None or not opts.measured_only or vtrain.get(s) is not None)]
    static_options = [s for s in candidates if s.global_batch_size == opts.static_global_batch]
    if not static_options:
        raise TTPError(f"static_global_batch={opts.static_global_batch}: no candidate strategy")
    static = min(static_options, key=clock.iteration_time)
    base = opts.static_global_batch
    corpus = build_corpus(CorpusConfig(seq_length=opts.seq_length, seed=opts.seed))
    progress = progress or (lambda name, point: None)
    out = Path(opts.out)

    # The baseline gets its best learning rate (the one CONA then scales): a static run per
    # candidate LR, the lowest final validation loss wins.
    sweep: dict[float, ChainResult] = {}
    for lr in opts.lr_sweep or (opts.lr,):
        sweep[lr] = _run_chain(f"static@{lr:g}" if opts.lr_sweep else "static", opts,
                               _Trainer(opts, corpus, base, lr), clock, static, None, None,
                               None, opts.static_samples, progress)
    lr = min(sweep, key=lambda k: sweep[k].points[-1].val_loss)
    static_run = sweep[lr]
    static_run.name = "static"
    trainer = _Trainer(opts, corpus, base, lr)
    target = static_run.points[-1].val_loss
    static_run.ttp = static_run.time_to(target)
    max_time = opts.max_time_factor * static_run.ttp

    controller = ConaController(
        candidates, CalibratedThroughput(predictor),
        SwitchPolicy(PolicyConfig(min_gain=opts.min_gain, patience=opts.patience,
                                  horizon_intervals=20),
                     SwitchCostModel(layout_prior_s=opts.layout_switch_s)),
        GradientNoiseScale(0.5, per_samples=opts.interval_samples),
        ControllerConfig(interval=1, base_batch=base),
        DecisionLog(out / "ttp_cona_decisions.jsonl" if rank == 0 else None))
    cona_run = _run_chain("cona", opts, trainer, clock, static, _ConaChooser(controller),
                          target, max_time, None, progress)
    cona_run.ttp = cona_run.time_to(target)

    hindsight = HindsightNoise(static_run.points + cona_run.points)
    oracle_run = _run_chain("oracle", opts, trainer, clock, static,
                            _OracleChooser(candidates, clock, hindsight, base,
                                           opts.interval_samples),
                            target, max_time, None, progress)
    oracle_run.ttp = oracle_run.time_to(target)

    ranks_note = CLOCK_NOTE.format(
        cluster=f"{opts.target_gpus}x {opts.target_device} {opts.target_precision}",
        model="GPT 1.3B: 24 layers, hidden 2048, 16 heads, seq 1024", ranks=ranks)
    report = {
        "note": ranks_note,
        "target_val_loss": target,
        "target_ppl": math.exp(target),
        "static_strategy": static.name,
        "lr": lr,
        "static_lr_sweep": {f"{k:g}": v.points[-1].val_loss for k, v in sweep.items()},
        "candidates": len(candidates),
        "dropped_for_memory": [(r.strategy.name, r.reason) for r in found.rejected],
        "clock_measured_lookups": clock.hits,
        "clock_predicted_lookups": clock.misses,
        "speedup_vs_static": static_run.ttp / cona_run.ttp,
        "gap_to_oracle_pct": 100.0 * (cona_run.ttp / oracle_run.ttp - 1.0),
        "oracle_speedup_vs_static": static_run.ttp / oracle_run.ttp,
        "runs": {r.name: {"ttp_s": r.ttp, "switches": r.switches,
                          "points": [asdict(p) for p in r.points]}
                 for r in (static_run, cona_run, oracle_run)},
        "options": {k: str(v) for k, v in asdict(opts).items()},
    }
    if rank == 0:
        from megatron_cona.plot import plot_ttp

        out.mkdir(parents=True, exist_ok=True)
        (out / "ttp.json").write_text(json.dumps(report, indent=1))
        plot_ttp(report, out / "ttp.png")
    return report
