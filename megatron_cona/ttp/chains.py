"""The chains of the time-to-perplexity evaluation: real training of a small model on the CPU
ranks, charged by the simulated clock, driven by a static choice, Megatron's batch ramp-up, a
:class:`~megatron_cona.session.ConaSession` (CONA, or Pollux-style with a DP-only layout), or the
branch-and-measure oracle.

Every chain of a case starts from the same initial weights (same seed), reads the same sample
sequence (sample ``i`` is window ``perm[i]`` of the corpus, whatever the batch size), validates on
the same held-out windows every ``interval_samples`` samples and is charged by the same clock.
The (DP, TP, PP) layout does not change the math, so the CPU ranks always execute the chosen
global batch as data parallelism (:func:`exec_strategy`) and the layout only sets the simulated
time; the global batch and the learning rate are real.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_cona.gns import GradStats, unbiased_estimates
from megatron_cona.lr_scaling import lr_scale
from megatron_cona.session import ConaSession, SwitchOutcome
from megatron_cona.ttp.clock import SimulatedClock
from predictors.spec import ParallelStrategy, TransformerSpec

EXEC_MAX_MICRO = 16


class TTPError(ValueError):
    """A TTP setting that cannot run (names the option)."""


def exec_strategy(global_batch: int, ranks: int, max_micro: int = EXEC_MAX_MICRO
                  ) -> ParallelStrategy:
    """How a global batch runs on the CPU ranks: data parallel, the largest power-of-two
    micro-batch (<= ``max_micro``) dividing the local batch, so evaluation batches of
    ``ranks * max_micro`` samples split evenly under every global batch."""
    if global_batch % ranks:
        raise TTPError(f"global batch {global_batch} is not divisible by ranks={ranks}")
    local = global_batch // ranks
    micro = 1
    while micro * 2 <= max_micro and local % (micro * 2) == 0:
        micro *= 2
    return ParallelStrategy(ranks, 1, 1, micro, global_batch)


@dataclass
class TrainerConfig:
    model: TransformerSpec
    seed: int
    warmup_samples: int
    decay_samples: int
    min_lr_fraction: float
    val_samples: int


@dataclass
class Snapshot:
    params: list[torch.Tensor]
    adam: list[dict[int, dict]]
    scheduler_steps: int
    iteration: int
    consumed_samples: int
    global_batch: int
    lr_scale: float


class Trainer:
    """The real training of one chain (the CONA runtime on the CPU ranks)."""

    def __init__(self, config: TrainerConfig, corpus) -> None:
        self.config, self.corpus = config, corpus
        self.ranks = dist.get_world_size()
        self.executor = None
        self.lr_scale = 1.0

    def start(self, lr: float, global_batch: int, scale: float) -> None:
        from megatron_cona.runtime import TrainConfig, build_state
        from megatron_cona.runtime.executor import RuntimeExecutor

        c = self.config
        cfg = TrainConfig(model=c.model, lr=lr, min_lr=lr * c.min_lr_fraction,
                          lr_warmup_samples=c.warmup_samples, lr_decay_samples=c.decay_samples,
                          lr_decay_style="cosine", adam_beta2=0.99, seed=c.seed)
        self.executor = RuntimeExecutor(build_state(cfg, exec_strategy(global_batch, self.ranks)))
        self.set_lr_scale(scale)

    @property
    def state(self):
        return self.executor.state

    def set_batch(self, global_batch: int) -> None:
        target = exec_strategy(global_batch, self.ranks)
        if target != self.state.strategy:
            outcome = self.executor.switch(target)
            if not outcome.switched:
                raise RuntimeError(f"switch to {target.name} failed: {outcome.error}")

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale
        self.executor.set_lr_scale(scale)

    def step(self):
        from megatron_cona.runtime import train_step

        return train_step(self.state, self.corpus.train, grad_stats=True)

    def val_loss(self) -> float:
        from megatron_cona.runtime import evaluate

        return evaluate(self.state, self.corpus.valid, 0, self.config.val_samples)

    def _adam(self):
        from megatron_cona.reshard.layout import inner_optimizer_states

        return inner_optimizer_states(self.state)

    def snapshot(self) -> Snapshot:
        adam = []
        for opt, st in self._adam():
            params = [p for g in opt.param_groups for p in g["params"]]
            adam.append({i: {k: v.clone() if torch.is_tensor(v) else v
                             for k, v in st[p].items()} for i, p in enumerate(params) if p in st})
        s = self.state
        return Snapshot([p.detach().clone() for p in s.core_model.parameters()], adam,
                        s.scheduler.num_steps, s.iteration, s.consumed_samples,
                        s.strategy.global_batch_size, self.lr_scale)

    def restore(self, snap: Snapshot) -> None:
        s = self.state
        with torch.no_grad():
            for p, saved in zip(s.core_model.parameters(), snap.params, strict=True):
                p.copy_(saved)
        for (opt, st), saved in zip(self._adam(), snap.adam, strict=True):
            params = [p for g in opt.param_groups for p in g["params"]]
            st.clear()
            for i, entry in saved.items():
                st[params[i]] = {k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in entry.items()}
        s.iteration, s.consumed_samples = snap.iteration, snap.consumed_samples
        s.scheduler.num_steps = snap.scheduler_steps
        self.set_batch(snap.global_batch)
        self.set_lr_scale(snap.lr_scale)  # also pushes the restored schedule's LR

    def close(self) -> None:
        self.state.destroy()
        self.executor = None


class SimulatedExecutor:
    """A :class:`~megatron_cona.session.Executor` on the simulated cluster: the strategy is the
    target cluster's, its batch change is executed for real by the trainer, and every switch is
    charged by the clock."""

    def __init__(self, clock: SimulatedClock, trainer: Trainer, start: ParallelStrategy) -> None:
        self.clock, self.trainer, self._strategy = clock, trainer, start
        self.pending: list[tuple[ParallelStrategy, ParallelStrategy, float]] = []

    @property
    def strategy(self) -> ParallelStrategy:
        return self._strategy

    def agree(self, strategy: ParallelStrategy) -> ParallelStrategy:
        return self.trainer.executor.agree(strategy)

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        old = self._strategy
        cost = self.clock.switch_time(old, target)
        if target.global_batch_size != old.global_batch_size:
            self.trainer.set_batch(target.global_batch_size)
        self._strategy = target
        self.pending.append((old, target, cost))
        return SwitchOutcome(True, cost, moved_tensors=old.layout != target.layout)

    def set_lr_scale(self, scale: float) -> None:
        self.trainer.set_lr_scale(scale)


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
    settings: dict
    points: list[Point] = field(default_factory=list)
    switches: list[dict] = field(default_factory=list)

    def time_to(self, target: float) -> float:
        """Simulated time at which validation loss first reaches ``target``, linearly
        interpolated between validation points (the first point is the initial state), so a
        chain is not penalized for where its validation points happen to fall."""
        for prev, p in zip(self.points, self.points[1:], strict=False):
            if p.val_loss <= target:
                if prev.val_loss <= target:
                    return prev.sim_time
                frac = (prev.val_loss - target) / (prev.val_loss - p.val_loss)
                return prev.sim_time + frac * (p.sim_time - prev.sim_time)
        return math.inf

    @property
    def final_loss(self) -> float:
        return self.points[-1].val_loss


class IntervalNoise:
    """Ratio of an interval's summed unbiased tr(S) and |G|^2 estimates (no smoothing)."""

    def __init__(self) -> None:
        self.tr = self.g2 = 0.0

    def add(self, stats: GradStats | None) -> None:
        sample = stats.sample() if stats is not None else None
        if sample is None:
            return
        small = sum(sample.small_sq) / len(sample.small_sq)
        g2, tr = unbiased_estimates(small, sample.big_sq, sample.small_batch, sample.big_batch)
        self.g2, self.tr = self.g2 + g2, self.tr + tr

    def value(self) -> float:
        return max(self.tr, 0.0) / self.g2 if self.g2 > 0 else math.nan


# ------------------------------------------------------------------------------- drivers


class Driver:
    """What changes a chain's strategy (default: nothing -- a static strategy)."""

    def bind(self, executor: SimulatedExecutor) -> None:
        self.executor = executor

    def before_step(self, samples: int) -> None:
        """Called before every iteration with the samples consumed so far."""

    def after_step(self, seconds: float, stats: GradStats | None) -> None:
        """Called after every iteration with its (simulated) time and gradient statistics."""

    def at_interval(self, point: Point) -> None:
        """Called at every validation point (not the last)."""


class RampupDriver(Driver):
    """Megatron's global-batch ramp-up (``--rampup-batch-size START INCR SAMPLES``), computed by
    megatron-core's own ``RampupBatchsizeNumMicroBatchesCalculator`` on one fixed layout."""

    def __init__(self, layout: tuple[int, int, int], micro_batch: int, start: int, increment: int,
                 ramp_samples: int, final: int) -> None:
        from megatron.core.num_microbatches_calculator import (
            RampupBatchsizeNumMicroBatchesCalculator,
        )

        self.layout, self.micro_batch = layout, micro_batch
        self.calculator = RampupBatchsizeNumMicroBatchesCalculator(
            final, micro_batch, layout[0], False, dist.get_rank(), start, increment, ramp_samples)

    def strategy_at(self, samples: int) -> ParallelStrategy:
        self.calculator.update(samples, consistency_check=True)
        return ParallelStrategy(*self.layout, self.micro_batch,
                                self.calculator.get_current_global_batch_size())

    def before_step(self, samples: int) -> None:
        target = self.strategy_at(samples)
        if target != self.executor.strategy:
            self.executor.switch(target)


class SessionDriver(Driver):
    """A :class:`ConaSession` (CONA, or Pollux-style) acting through the simulated executor."""

    def __init__(self, make_session: Callable[[SimulatedExecutor], ConaSession]) -> None:
        self.make_session = make_session
        self.session: ConaSession | None = None

    def bind(self, executor: SimulatedExecutor) -> None:
        super().bind(executor)
        self.session = self.make_session(executor)

    def after_step(self, seconds: float, stats: GradStats | None) -> None:
        self.session.observe(seconds, stats)

    def at_interval(self, point: Point) -> None:
        decision = self.session.decide(point.samples, sim_time=point.sim_time,
                                       val_loss=point.val_loss)
        self.session.act(point.samples, decision)


# --------------------------------------------------------------------------------- chains


@dataclass
class Budget:
    interval_samples: int
    stop_loss: float | None = None
    max_time: float | None = None
    max_samples: int | None = None


def run_chain(name: str, settings: dict, trainer: Trainer, clock: SimulatedClock,
              start: ParallelStrategy, lr: float, scale: float, driver: Driver, budget: Budget,
              progress: Callable[[str, Point], None]) -> ChainResult:
    """Train from the initial state under ``driver`` until the budget's target loss, simulated
    time or sample cap (checked at validation points)."""
    result = ChainResult(name, settings)
    trainer.start(lr, start.global_batch_size, scale)
    executor = SimulatedExecutor(clock, trainer, start)
    driver.bind(executor)
    sim, samples, next_eval = 0.0, 0, budget.interval_samples
    noise, losses = IntervalNoise(), []
    result.points.append(Point(0, 0.0, trainer.val_loss(), math.nan, start.name, math.nan))

    def charge() -> float:
        total = 0.0
        for old, new, cost in executor.pending:
            total += cost
            result.switches.append({"samples": samples, "sim_time": sim + total,
                                    "from": old.name, "to": new.name, "cost_s": cost})
        executor.pending.clear()
        return total

    try:
        while True:
            driver.before_step(samples)
            sim += charge()
            step = trainer.step()
            if not math.isfinite(step.loss):
                raise RuntimeError(f"{name}: loss={step.loss} at {samples} samples")
            seconds = clock.iteration_time(executor.strategy)
            sim += seconds
            samples += executor.strategy.global_batch_size
            losses.append(step.loss)
            noise.add(step.grad_stats)
            driver.after_step(seconds, step.grad_stats)
            if samples < next_eval:
                continue
            while next_eval <= samples:
                next_eval += budget.interval_samples
            point = Point(samples, sim, trainer.val_loss(), sum(losses) / len(losses),
                          executor.strategy.name, noise.value())
            result.points.append(point)
            noise, losses = IntervalNoise(), []
            progress(name, point)
            if _done(point, budget):
                break
            driver.at_interval(point)
            sim += charge()
    finally:
        trainer.close()
    return result


def _done(point: Point, budget: Budget) -> bool:
    return ((budget.stop_loss is not None and point.val_loss <= budget.stop_loss)
            or (budget.max_time is not None and point.sim_time >= budget.max_time)
            or (budget.max_samples is not None and point.samples >= budget.max_samples))


def _crossing(times: list[float], vals: list[float], target: float) -> float:
    """First time the piecewise-linear curve (times, vals) reaches ``target`` (inf: never)."""
    for k in range(1, len(vals)):
        if vals[k] <= target:
            if vals[k - 1] <= target:
                return times[k - 1]
            frac = (vals[k - 1] - target) / (vals[k - 1] - vals[k])
            return times[k - 1] + frac * (times[k] - times[k - 1])
    return math.inf


def run_oracle(trainer: Trainer, clock: SimulatedClock, candidates: list[ParallelStrategy],
               start: ParallelStrategy, lr: float, base_batch: int, budget: Budget,
               progress: Callable[[str, Point], None]) -> ChainResult:
    """Branch-and-measure with rollouts: at every interval snapshot the state and train every
    candidate from it; continue each branch with its own candidate until it reaches the target
    (the rollout, all measured), and keep the candidate whose branch reaches the target first
    in simulated time (switch cost included); if no rollout reaches it within the time budget,
    keep the largest measured validation-loss decrease per simulated second. Training is
    deterministic, so this is never slower than any static strategy (each is a rollout of the
    first decision, and every later decision can keep it) -- unlike a greedy one-interval rule,
    which a static chain beat on small cases (LR warmup makes early progress misleading).

    Candidates with the same global batch train identically (the layout does not change the
    math; the learning rate follows the batch by the same sqrt rule as CONA), so one real branch
    per global batch is trained and every layout of that batch is scored with its own clock time
    and switch cost -- the same as training each candidate separately. The first choice (from
    the initial weights) is charged no switch: the oracle picks its starting strategy freely."""
    result = ChainResult("oracle", {"lr": lr, "branches": "every candidate, every interval, "
                                                          "rolled out to the target"})
    by_batch: dict[int, list[ParallelStrategy]] = {}
    for s in candidates:
        by_batch.setdefault(s.global_batch_size, []).append(s)
    interval = budget.interval_samples
    for gb in by_batch:
        if interval % gb:
            raise TTPError(f"interval_samples={interval} must be a multiple of every candidate "
                           f"global batch (got {gb})")
    target = budget.stop_loss if budget.stop_loss is not None else -math.inf
    trainer.start(lr, start.global_batch_size, lr_scale("sqrt", start.global_batch_size,
                                                        base_batch))
    # the first choice is free: nothing runs yet, so no switch is charged
    current: ParallelStrategy | None = None
    sim, samples = 0.0, 0
    val = trainer.val_loss()
    result.points.append(Point(0, 0.0, val, math.nan, start.name, math.nan))

    def train_interval(gb: int) -> tuple[float, float, float]:
        noise, losses = IntervalNoise(), []
        for _ in range(interval // gb):
            step = trainer.step()
            losses.append(step.loss)
            noise.add(step.grad_stats)
        return trainer.val_loss(), sum(losses) / len(losses), noise.value()

    try:
        while True:
            base = trainer.snapshot()
            best = None  # (time to target, rate, strategy, seconds, snapshot, point fields)
            horizon = (budget.max_time - sim) if budget.max_time is not None else math.inf
            for gb in sorted(by_batch):
                trainer.restore(base)
                trainer.set_batch(gb)
                trainer.set_lr_scale(lr_scale("sqrt", gb, base_batch))
                after, train_loss, phi = train_interval(gb)
                end = trainer.snapshot()
                # rollout: keep this batch until the target, while it can still win
                vals = [val, after]
                fastest = min(clock.iteration_time(s) for s in by_batch[gb]) * (interval // gb)
                limit = min(horizon, best[0] if best else math.inf)
                while vals[-1] > target and (len(vals) - 1) * fastest < limit:
                    vals.append(train_interval(gb)[0])
                for s in by_batch[gb]:
                    switch = 0.0 if current is None else clock.switch_time(current, s)
                    step_s = interval // gb * clock.iteration_time(s)
                    times = [0.0] + [switch + k * step_s for k in range(1, len(vals))]
                    reach = _crossing(times, vals, target)
                    rate = (val - after) / (switch + step_s)
                    if best is None or (reach, -rate) < (best[0], -best[1]):
                        best = (reach, rate, s, switch + step_s, end, after, train_loss, phi)
            _, _, chosen, seconds, end, after, train_loss, phi = best
            trainer.restore(end)
            if current is None:  # the free first choice is where the chain starts
                result.points[0].strategy = chosen.name
            elif chosen != current:
                result.switches.append({"samples": samples, "sim_time": sim, "from": current.name,
                                        "to": chosen.name,
                                        "cost_s": clock.switch_time(current, chosen)})
            current, sim, samples, val = chosen, sim + seconds, samples + interval, after
            point = Point(samples, sim, val, train_loss, current.name, phi)
            result.points.append(point)
            progress("oracle", point)
            if _done(point, budget):
                break
    finally:
        trainer.close()
    return result
