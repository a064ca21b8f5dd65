"""The chains of the TTP evaluation, moving in the stitched model of
:mod:`megatron_cona.ttp.stitch` on the simulated clock: a static strategy, a
:class:`~megatron_cona.session.ConaSession` (CONA) or any other :class:`Driver` decides at
interval boundaries; training progress and gradient statistics are the cached real curves'.

The chain's layout only sets the simulated time (it does not change the math); its global batch
picks the curve; its learning rate is the case's one LR rule (:class:`~megatron_cona.lr_scaling.
BatchLR`), the rule the curves were trained with -- a session whose LR rule differs is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_cona.executor import SingleProcessExecutor, SwitchOutcome
from megatron_cona.gns import GradStats, unbiased_estimates
from megatron_cona.lr_scaling import BatchLR
from megatron_cona.ttp.clock import SimulatedClock
from megatron_cona.ttp.curves import Curve
from megatron_cona.ttp.stitch import CurveSet
from predictors.spec import ParallelStrategy


class TTPError(ValueError):
    """A TTP setting that cannot run (names the option)."""


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
        interpolated between points (a switch adds a flat point: its cost trains nothing)."""
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


def grad_stats(entry) -> GradStats | None:
    """A curve's recorded iteration statistics as the runtime reports them (one replica: the
    first micro-batch is the small batch)."""
    small, small_batch, big, big_batch = entry
    if not big_batch or math.isnan(big):
        return None
    return GradStats([big], big_batch, big, big_batch, first_microbatch_sq_norm=small,
                     micro_batch=small_batch)


def interval_noise(stats) -> float:
    """Ratio of an interval's summed unbiased tr(S) and |G|^2 estimates (no smoothing)."""
    g2 = tr = 0.0
    for small, small_batch, big, big_batch in stats:
        if big_batch and small_batch and not math.isnan(big):
            a, b = unbiased_estimates(small, big, small_batch, big_batch)
            g2, tr = g2 + a, tr + b
    return max(tr, 0.0) / g2 if g2 > 0 else math.nan


class ReplayExecutor(SingleProcessExecutor):
    """A :class:`~megatron_cona.session.Executor` in the stitched model: a switch moves the
    chain onto the new batch's curve at its current loss and is charged by the clock."""

    def __init__(self, clock: SimulatedClock, curves: CurveSet, lr: BatchLR,
                 start: ParallelStrategy) -> None:
        super().__init__(start)
        self.clock, self.curves, self.lr = clock, curves, lr
        self.position = 0.0
        self.loss = curves.initial_loss

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        old = self._strategy
        if target.global_batch_size not in self.curves.tracks:
            return SwitchOutcome(False, 0.0, error=f"no curve at global batch "
                                                   f"{target.global_batch_size}")
        if target.global_batch_size != old.global_batch_size:
            x = self.curves.enter(target.global_batch_size, self.loss)
            if x is None:
                return SwitchOutcome(False, 0.0, error="that batch's curve never reaches the "
                                                       f"current loss {self.loss:.4f}")
            self.position = x
        cost = self.clock.switch_time(old, target)
        self._strategy = target
        self.pending.append((old, target, cost))
        return SwitchOutcome(True, cost, moved_tensors=old.layout != target.layout)

    def set_lr_scale(self, scale: float) -> None:
        want = self.lr.scale(self._strategy.global_batch_size)
        if not math.isclose(scale, want, rel_tol=1e-9):
            raise TTPError(f"LR scale {scale} at global batch {self._strategy.global_batch_size}"
                           f" differs from the case's LR rule {self.lr.name} ({want}): every "
                           "chain must use the one LR rule")


class Driver:
    """What changes a chain's strategy (default: nothing -- a static strategy)."""

    def bind(self, executor: ReplayExecutor) -> None:
        self.executor = executor

    def after_step(self, seconds: float, stats: GradStats | None) -> None:
        """Called after every iteration with its simulated time and gradient statistics."""

    def at_interval(self, point: Point) -> None:
        """Called at every interval boundary (not the last)."""


def replay_chain(name: str, settings: dict, curves: CurveSet, clock: SimulatedClock,
                 lr: BatchLR, start: ParallelStrategy, driver: Driver, target: float,
                 max_time: float = math.inf) -> ChainResult:
    """Run ``driver`` from the initial state until ``target``, ``max_time`` or the end of the
    curve it is on."""
    result = ChainResult(name, settings)
    ex = ReplayExecutor(clock, curves, lr, start)
    driver.bind(ex)
    sim, samples = 0.0, 0
    result.points.append(Point(0, 0.0, ex.loss, math.nan, start.name, math.nan))
    interval = curves.interval
    while True:
        s = ex.strategy
        b = s.global_batch_size
        track = curves.tracks[b]
        nxt = curves.advance(b, ex.position)
        if nxt is None:
            break  # this batch's curve ends here (never reached the target in its run)
        step_s = clock.iteration_time(s)
        k = track.interval_index(ex.position)
        stats = track.curve.stats[k] if track.curve is not None else []
        for entry in stats:
            driver.after_step(step_s, grad_stats(entry))
        sim += interval // b * step_s
        samples += interval
        ex.position += interval
        ex.loss = nxt
        train = track.curve.train_loss[k + 1] if track.curve is not None else math.nan
        point = Point(samples, sim, nxt, train, s.name, interval_noise(stats))
        result.points.append(point)
        if nxt <= target or sim >= max_time:
            break
        driver.at_interval(point)
        for old, new, cost in ex.pending:
            result.switches.append({"samples": samples, "sim_time": sim, "from": old.name,
                                    "to": new.name, "cost_s": cost})
            sim += cost
        if ex.pending:  # the switch trains nothing: a flat stretch
            result.points.append(Point(samples, sim, ex.loss, math.nan, ex.strategy.name,
                                       math.nan))
        ex.pending.clear()
    return result


def replay_schedule(name: str, settings: dict, curve: Curve, clock: SimulatedClock,
                    layout: tuple[int, int, int], micro_batch: int, target: float) -> ChainResult:
    """A chain whose batch schedule is its own curve's (Megatron's ramp-up): every recorded
    iteration charged at its global batch on ``layout``, batch changes at the clock's cost."""
    result = ChainResult(name, settings)
    sim, prev = 0.0, None
    result.points.append(Point(0, 0.0, curve.val_loss[0], math.nan, "", math.nan))
    for k, stats in enumerate(curve.stats):
        for entry in stats:
            batch = entry[3]
            if not batch:
                raise TTPError(f"curve {curve.key}: iteration without its global batch")
            s = ParallelStrategy(*layout, micro_batch, batch)
            if prev is not None and s != prev:
                cost = clock.switch_time(prev, s)
                result.switches.append({"samples": curve.samples[k], "sim_time": sim,
                                        "from": prev.name, "to": s.name, "cost_s": cost})
                sim += cost
            sim += clock.iteration_time(s)
            prev = s
        if k == 0:
            result.points[0].strategy = ParallelStrategy(*layout, micro_batch,
                                                         stats[0][3]).name
        result.points.append(Point(curve.samples[k + 1], sim, curve.val_loss[k + 1],
                                   curve.train_loss[k + 1], prev.name, interval_noise(stats)))
        if curve.val_loss[k + 1] <= target:
            break
    return result
