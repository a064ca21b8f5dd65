"""The chains of a TTP case as a registry: every :class:`Baseline` turns a case
(:class:`CaseInputs`) into a :class:`~megatron_cona.ttp.chains.ChainResult`; the case runner,
the summary, the plot and the CLI iterate over :data:`BASELINES`. A rival that lives outside
the product (Pollux through adaptdl's own code, in ``benchmarks/``) registers itself the same
way with :func:`register`.

Built in (all on the same curves, clock, switch costs and one LR rule):

* ``planner`` -- the fastest layout at the user's global batch (an offline planner's pick);
* ``static`` -- hindsight-best static (global batch, layout) at the case's LR rule (in the
  ``table`` variant each batch has its own swept LR: hindsight-best (batch, layout, LR));
* ``rampup`` -- Megatron's ``--rampup-batch-size START START SAMPLES`` to the user's batch,
  swept over START and SAMPLES, hindsight best (its own real curves: megatron-core's calculator);
* ``cona`` -- the CONA session over every candidate, from the planner's strategy;
* ``bound`` -- the DP over every (global batch x layout) sequence (the reference; not a rival).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_cona.gns import GradientNoiseScale
from megatron_cona.goodput import CalibratedThroughput
from megatron_cona.lr_scaling import BatchLR
from megatron_cona.policy import DecisionLog, PolicyConfig, SwitchPolicy
from megatron_cona.session import ConaSession, SessionConfig
from megatron_cona.ttp.bound import dp_bound
from megatron_cona.ttp.chains import (
    ChainResult,
    Driver,
    Point,
    TTPError,
    replay_chain,
    replay_schedule,
)
from megatron_cona.ttp.clock import SimulatedClock, TableThroughput
from megatron_cona.ttp.curves import Curve
from megatron_cona.ttp.stitch import CurveSet
from predictors.spec import ParallelStrategy


@dataclass
class CaseInputs:
    """Everything a chain of one case may use (the same for every chain)."""

    tag: str  # e.g. gpt/s1234/table
    curves: CurveSet  # static curves of this LR variant, by global batch
    ramps: dict[str, Curve]  # Megatron ramp-up curves of this LR variant, by flag
    clock: SimulatedClock
    candidates: list[ParallelStrategy]
    predicted: dict[ParallelStrategy, float]  # CONA's held-out predictor
    lr: BatchLR
    user_batch: int
    target: float
    max_time: float
    interval: int
    policy: PolicyConfig
    noise_z: float = 1.0
    log_dir: Path | None = None
    bound_snap: float = 0.0

    def fastest(self, batch: int, only=None) -> ParallelStrategy:
        pool = [s for s in (only or self.candidates) if s.global_batch_size == batch]
        if not pool:
            raise TTPError(f"no candidate at global batch {batch}")
        return min(pool, key=lambda s: (self.clock.iteration_time(s), s.name))

    def session(self, name: str, candidates: list[ParallelStrategy], executor) -> ConaSession:
        path = self.log_dir / f"{self.tag.replace('/', '_')}_{name}_decisions.jsonl" \
            if self.log_dir else None
        cfg = SessionConfig(interval=1, base_batch=self.user_batch,
                            lr_rule="sqrt" if self.lr.rule == "table" else self.lr.rule,
                            lr_table=dict(self.lr.table) if self.lr.rule == "table" else None,
                            noise_z=self.noise_z)
        return ConaSession(candidates, CalibratedThroughput(TableThroughput(
            {s: self.predicted[s] for s in candidates})), SwitchPolicy(self.policy),
            GradientNoiseScale(0.5, per_samples=self.interval), cfg, executor, DecisionLog(path))


@dataclass(frozen=True)
class Baseline:
    name: str
    run: Callable[[CaseInputs], ChainResult | None]
    color: str
    rival: bool = True  # CONA's speedup over it is reported
    in_bound_space: bool = True  # moves in the stitched model: must not beat the bound
    doc: str = ""


BASELINES: dict[str, Baseline] = {}


def register(baseline: Baseline) -> Baseline:
    BASELINES[baseline.name] = baseline
    return baseline


# ------------------------------------------------------------------------------- chains


def _static(case: CaseInputs, strategy: ParallelStrategy, name: str) -> ChainResult:
    return replay_chain(name, {"start": strategy.name, "lr": case.lr.lr(
        strategy.global_batch_size)}, case.curves, case.clock, case.lr, strategy, Driver(),
        case.target, case.max_time)


def run_planner(case: CaseInputs) -> ChainResult:
    return _static(case, case.fastest(case.user_batch), "planner")


def run_static(case: CaseInputs) -> ChainResult:
    runs = [_static(case, case.fastest(b), "static") for b in case.curves.batches
            if any(s.global_batch_size == b for s in case.candidates)]
    best = min(runs, key=lambda r: (r.time_to(case.target), r.final_loss))
    best.settings["swept"] = {r.settings["start"]: r.time_to(case.target) for r in runs}
    return best


def rampup_layout(case: CaseInputs, batches: list[int]) -> tuple[tuple, int] | None:
    """Fastest (layout, micro-batch) at the final batch whose every ramp batch the clock can
    charge (Megatron keeps one layout and micro-batch for the whole ramp)."""
    final = max(batches)
    options = []
    for s in case.candidates:
        if s.global_batch_size != final:
            continue
        if any(b % (s.dp * s.micro_batch) for b in batches):
            continue
        if all(case.clock.has_time(ParallelStrategy(*s.layout, s.micro_batch, b))
               for b in batches):
            options.append(s)
    if not options:
        return None
    s = min(options, key=lambda x: (case.clock.iteration_time(x), x.name))
    return s.layout, s.micro_batch


def run_rampup(case: CaseInputs) -> ChainResult | None:
    runs = []
    for flag, curve in case.ramps.items():
        batches = sorted({e[3] for it in curve.stats for e in it})
        where = rampup_layout(case, batches)
        if where is None:
            continue
        runs.append(replay_schedule("rampup", {"rampup": flag, "lr": case.lr.name,
                                               "layout": list(where[0]), "micro": where[1]},
                                    curve, case.clock, where[0], where[1], case.target))
    if not runs:
        return None
    best = min(runs, key=lambda r: (r.time_to(case.target), r.final_loss))
    best.settings["swept"] = {r.settings["rampup"]: r.time_to(case.target) for r in runs}
    return best


class SessionDriver(Driver):
    """A :class:`ConaSession` acting through the replay executor."""

    def __init__(self, make: Callable[[object], ConaSession]) -> None:
        self.make = make
        self.session: ConaSession | None = None

    def bind(self, executor) -> None:
        super().bind(executor)
        self.session = self.make(executor)

    def after_step(self, seconds, stats) -> None:
        self.session.observe(seconds, stats)

    def at_interval(self, point: Point) -> None:
        decision = self.session.decide(point.samples, sim_time=point.sim_time,
                                       val_loss=point.val_loss)
        self.session.act(point.samples, decision)


def run_cona(case: CaseInputs) -> ChainResult:
    start = case.fastest(case.user_batch)
    return replay_chain("cona", {"start": start.name, "lr": case.lr.name}, case.curves,
                        case.clock, case.lr, start,
                        SessionDriver(lambda ex: case.session("cona", case.candidates, ex)),
                        case.target, case.max_time)


def run_bound(case: CaseInputs) -> ChainResult:
    """The DP bound's sequence as a chain (its points are the bound's own path)."""
    usable = [s for s in case.candidates if s.global_batch_size in case.curves.tracks]
    res = dp_bound(case.curves, usable, case.clock.iteration_time, case.clock.switch_time,
                   case.target, snap=case.bound_snap)
    out = ChainResult("bound", {"states": res.states, "snap": case.bound_snap,
                                "bound_s": res.time})
    if not res.path:
        out.points.append(Point(0, 0.0, case.curves.initial_loss, math.nan, "", math.nan))
        return out
    # points at interval ends, labelled with the strategy that ran up to them
    out.points.append(Point(0, 0.0, res.path[0][1], math.nan, res.path[0][2].name, math.nan))
    for (_, _, prev), (t, loss, s) in zip(res.path, res.path[1:], strict=False):
        out.points.append(Point(0, t, loss, math.nan, prev.name, math.nan))
        if s != prev:
            out.switches.append({"sim_time": t, "from": prev.name, "to": s.name})
    out.points.append(Point(0, res.time, case.target, math.nan, res.path[-1][2].name, math.nan))
    return out


register(Baseline("planner", run_planner, "tab:gray",
                  doc="fastest layout at the user's global batch"))
register(Baseline("static", run_static, "tab:brown",
                  doc="hindsight-best static (batch, layout) at the case's LR rule"))
register(Baseline("rampup", run_rampup, "tab:orange", in_bound_space=False,
                  doc="Megatron --rampup-batch-size, swept, hindsight best (own real curves)"))
register(Baseline("cona", run_cona, "tab:blue", rival=False, doc="CONA"))
register(Baseline("bound", run_bound, "tab:green", rival=False,
                  doc="DP over (global batch x layout) sequences: the true bound"))


def bound_violations(results: dict[str, ChainResult], target: float, tol: float = 1e-9
                     ) -> list[str]:
    """Chains of the bound's search space that beat it (each one is a bug)."""
    bound = results["bound"].settings["bound_s"]
    return [f"{name}: {r.time_to(target):.6f} s < bound {bound:.6f} s"
            for name, r in results.items()
            if name != "bound" and BASELINES[name].in_bound_space
            and r.time_to(target) < bound * (1 - tol)]


