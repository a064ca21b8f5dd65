"""Every chain of the law-based simulation on the same dynamics, clock and switch costs, as a
registry (:data:`CHAINS`; Pollux registers from ``benchmarks/`` through :func:`register`).

A chain is a :class:`Driver` deciding at the case's decision boundaries through a
:class:`SimExecutor`. Drivers that observe get, per interval, what a real job's probe and timer
would report (iteration seconds from the clock, :class:`~megatron_cona.gns.GradStats` from
:class:`~megatron_cona.lawsim.probe.SimulatedProbe`) -- never the law's state. The learning
rate is the law's: tuned per batch (McCandlish's dS_min assumes it), so an LR scale a
controller sets changes nothing and is recorded only.

Built in: ``planner`` (fastest layout at the paper's batch), ``static`` (hindsight-best batch),
``rampup`` (Megatron's --rampup-batch-size as GPT-3 did, swept), ``seesaw`` (batch x2 wherever
cosine decay would halve the LR, Meterez et al. 2025; swept start batch), ``cona`` (the real
ConaSession) and ``bound`` (exact DP; the reference, not a rival).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron_cona.executor import SingleProcessExecutor, SwitchOutcome
from megatron_cona.gns import GradientNoiseScale, GradStats
from megatron_cona.goodput import CalibratedThroughput
from megatron_cona.lawsim.bound import exact_bound, relaxed_bound
from megatron_cona.lawsim.cases import SimCase
from megatron_cona.lawsim.clock import TableThroughput
from megatron_cona.lawsim.constants import value
from megatron_cona.lawsim.probe import SimulatedProbe
from megatron_cona.lawsim.schedules import rampup_batch, seesaw_batch
from megatron_cona.policy import DecisionLog, SwitchCostModel, SwitchPolicy
from megatron_cona.session import ConaSession, SessionConfig
from predictors.spec import ParallelStrategy

READINGS = 8  # probe readings reported per interval (each stands for 1/8 of its iterations)


@dataclass
class SimPoint:
    tokens: float
    time: float
    loss: float
    strategy: str


@dataclass
class SimResult:
    name: str
    settings: dict
    points: list[SimPoint] = field(default_factory=list)
    switches: list[dict] = field(default_factory=list)
    hits: dict[str, float] = field(default_factory=dict)  # target -> seconds

    def time_to(self, target: str) -> float:
        return self.hits.get(target, math.inf)

    def path(self) -> list[str]:
        """The strategies run, in order, without repeats."""
        out: list[str] = []
        for p in self.points:
            if p.strategy and (not out or out[-1] != p.strategy):
                out.append(p.strategy)
        return out


class SimExecutor(SingleProcessExecutor):
    """A :class:`~megatron_cona.session.Executor` on the simulated cluster: a switch is charged
    by the clock at the next boundary."""

    def __init__(self, clock, start: ParallelStrategy) -> None:
        super().__init__(start)
        self.clock = clock  # the executor knows the cluster, never the law
        self.lr_scales: list[float] = []

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        if not self.clock.has_time(target):
            return SwitchOutcome(False, 0.0, error=f"the clock has no time for {target.name}")
        old, self._strategy = self._strategy, target
        cost = self.clock.switch_time(old, target)
        self.pending.append((old, target, cost))
        return SwitchOutcome(True, cost, moved_tensors=old.layout != target.layout)

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scales.append(scale)


class Driver:
    """What changes a chain's strategy (default: nothing -- a static strategy)."""

    observes = False  # whether it is handed the probe's readings

    def bind(self, executor: SimExecutor) -> None:
        self.executor = executor

    def observe(self, seconds: float, stats: GradStats | None, iterations: float,
                loss: float) -> None:
        """A reading standing for ``iterations`` iterations of ``seconds`` each, with their
        mean training loss (noisy, as a real loop reads it)."""

    def at_boundary(self, tokens: float) -> None:
        """Called at every decision boundary (after ``tokens`` tokens), not the last."""


def run_chain(case: SimCase, name: str, settings: dict, start: ParallelStrategy,
              driver: Driver, seed_offset: int = 0) -> SimResult:
    """Run ``driver`` from the law's initial state until every target is reached or the
    boundaries end."""
    dyn, seq = case.dynamics, case.seq
    result = SimResult(name, settings)
    ex = SimExecutor(case.clock, start)
    driver.bind(ex)
    probe = SimulatedProbe(np.random.default_rng(case.seed + seed_offset),
                           value("probe_effective_dims"))
    loss_rng = np.random.default_rng([case.seed + seed_offset, 1])
    s, t = case.law.s0, 0.0
    result.points.append(SimPoint(0.0, 0.0, case.loss(s), ex.strategy.name))  # after begin()
    for d, d_next in zip(case.boundaries, case.boundaries[1:], strict=False):
        strategy = ex.strategy
        tokens, batch = d_next - d, strategy.global_batch_size * seq
        iter_s = case.clock.iteration_time(strategy)
        s2 = dyn.advance(s, d, batch, tokens)
        for target, goal in case.goals.items():
            if target not in result.hits and s < goal <= s2:
                result.hits[target] = t + dyn.tokens_to(s, d, batch, goal) / batch * iter_s
        if driver.observes:
            iterations = tokens / batch
            n = max(1, min(READINGS, int(iterations)))
            # a reading's loss: the mean over its iterations, each step's noise of the size
            # the project's real loop shows (constants: loss_noise_per_token)
            sd = value("loss_noise_per_token") / math.sqrt(batch * iterations / n)
            for i in range(n):
                part = (i + 0.5) / n * tokens
                s_part = dyn.advance(s, d, batch, part)
                noise = dyn.b_crit(s_part, d + part) / seq / case.probe_bias
                driver.observe(iter_s, probe.read(strategy, noise), iterations / n,
                               case.loss(s_part) + sd * loss_rng.normal())
        s, t = s2, t + tokens / batch * iter_s
        result.points.append(SimPoint(d_next, t, case.loss(s), strategy.name))
        if len(result.hits) == len(case.goals):
            break
        driver.at_boundary(d_next)
        for old, new, cost in ex.pending:
            result.switches.append({"tokens": d_next, "time": t, "from": old.name,
                                    "to": new.name, "cost_s": cost})
            t += cost
        if ex.pending:
            result.points.append(SimPoint(d_next, t, case.loss(s), ex.strategy.name))
        ex.pending.clear()
    return result


# ------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Chain:
    name: str
    run: Callable[[SimCase], list[SimResult]]  # the sweep; hindsight best per target
    color: str
    rival: bool = True  # CONA's speedup over it is reported
    in_bound_space: bool = True  # every strategy it runs is a candidate: must not beat the bound
    doc: str = ""


CHAINS: dict[str, Chain] = {}
# chains registered from outside the package, by name (so that ``--skip`` knows them where they
# are not registered): what registers each
ELSEWHERE = {"pollux": "benchmarks/cona_pollux.py, where adaptdl is installed"}


def register(chain: Chain) -> Chain:
    CHAINS[chain.name] = chain
    return chain


# -------------------------------------------------------------------------------- chains


def run_planner(case: SimCase) -> list[SimResult]:
    start = case.fastest(case.paper_batch)
    return [run_chain(case, "planner", {"start": start.name}, start, Driver())]


def run_static(case: SimCase) -> list[SimResult]:
    return [run_chain(case, "static", {"start": case.fastest(b).name}, case.fastest(b), Driver())
            for b in case.batches]


class ScheduleDriver(Driver):
    """A batch schedule in tokens seen: at each boundary the schedule's batch on ``place(b)``."""

    def __init__(self, batch_at: Callable[[float], int],
                 place: Callable[[int], ParallelStrategy]) -> None:
        self.batch_at, self.place = batch_at, place

    def at_boundary(self, tokens: float) -> None:
        target = self.place(self.batch_at(tokens))
        if target != self.executor.strategy:
            self.executor.switch(target)


def _ramp_place(case: SimCase, start: int) -> Callable[[int], ParallelStrategy] | None:
    """Megatron keeps one layout and micro-batch for the whole ramp: the fastest one at the
    final batch whose DP x micro divides the start batch and whose every ramp batch the clock
    can charge."""
    final = case.paper_batch
    options = [s for s in case.candidates if s.global_batch_size == final
               and start % (s.dp * s.micro_batch) == 0
               and all(case.clock.has_time(ParallelStrategy(*s.layout, s.micro_batch, b))
                       for b in range(start, final + 1, start))]
    if not options:
        return None
    s = min(options, key=lambda x: (case.clock.iteration_time(x), x.name))
    return lambda b: ParallelStrategy(*s.layout, s.micro_batch, b)


def run_rampup(case: SimCase) -> list[SimResult]:
    seq, final = case.seq, case.paper_batch
    far = value("tokens_per_param") * case.family.spec.num_parameters()
    gpt3_start = value("gpt3_rampup_start_tokens") / seq
    starts = sorted({b for b in case.batches if b < final and (b >= gpt3_start
                                                                or b == case.batches[0])})
    ramps = sorted({value("gpt3_rampup_tokens_lo"), value("gpt3_rampup_tokens_hi"),
                    0.03 * far, 0.1 * far, 0.3 * far})
    runs = []
    for start in starts[:3]:
        place = _ramp_place(case, start)
        if place is None:
            continue
        for ramp in ramps:
            def batch_at(tokens, start=start, ramp=ramp):
                return rampup_batch(tokens, seq, start, final, ramp)
            runs.append(run_chain(case, "rampup", {"start_batch": start, "ramp_tokens": ramp},
                                  place(start), ScheduleDriver(batch_at, place)))
    return runs


def run_seesaw(case: SimCase) -> list[SimResult]:
    far = value("tokens_per_param") * case.family.spec.num_parameters()
    cap = case.batches[-1]
    runs = []
    for start in case.batches:
        if start > case.paper_batch:
            continue
        def batch_at(tokens, start=start):
            b = seesaw_batch(tokens, start, far, cap)
            return max(x for x in case.batches if x <= b)
        runs.append(run_chain(case, "seesaw", {"start_batch": start, "budget_tokens": far},
                              case.fastest(start), ScheduleDriver(batch_at, case.fastest)))
    return runs


class SessionDriver(Driver):
    """The real :class:`ConaSession` acting through the simulated executor."""

    observes = True

    def __init__(self, make: Callable[[SimExecutor], ConaSession]) -> None:
        self.make = make
        self.session: ConaSession | None = None

    def bind(self, executor: SimExecutor) -> None:
        super().bind(executor)
        self.session = self.make(executor)
        self.session.begin()

    def observe(self, seconds, stats, iterations, loss) -> None:
        self.session.observe(seconds, stats, iterations, loss=loss)

    def at_boundary(self, tokens: float) -> None:
        decision = self.session.decide(int(tokens), tokens=tokens)
        self.session.act(int(tokens), decision)


def cona_session(case: SimCase, executor: SimExecutor, log_path=None) -> ConaSession:
    """CONA as configured for a job whose LR is tuned per batch: Pollux's efficiency term
    (the AdaScale gain is the step's worth under that LR), noise-scale EMA halving per
    interval, the case's policy."""
    table = {s: case.predicted(s) for s in case.candidates}
    config = SessionConfig(interval=1, base_batch=case.paper_batch, lr_rule="adascale",
                           noise_z=case.noise_z)
    times = CalibratedThroughput(TableThroughput(table), prior_error=case.prediction_error)
    # the job timed its own state's build at start, as pretrain_gpt does: the clock's measured
    # fixed part of a layout switch is that build (plus the plan and the finalize)
    costs = SwitchCostModel.for_build(case.clock.fixed_switch_s)
    return ConaSession(case.candidates, times, SwitchPolicy(case.policy, costs),
                       GradientNoiseScale(0.5 ** (1 / READINGS)),
                       config, executor, DecisionLog(log_path))


def run_cona(case: SimCase) -> list[SimResult]:
    start = case.fastest(case.paper_batch)
    driver = SessionDriver(lambda ex: cona_session(case, ex, case.extra.get("cona_log")))
    result = run_chain(case, "cona", {"start": start.name}, start, driver)
    result.settings["decisions"] = len(driver.session.decisions)
    return [result]


def progress_rate(case: SimCase, s: float, d: float, span: float, x: ParallelStrategy,
                  switch_s: float = 0.0) -> float:
    """S_min gained per second by ``x`` over the next ``span`` tokens from the law's state
    (``s``, ``d``), ``switch_s`` seconds of switching included: the oracle's one criterion, for
    its start and at every boundary."""
    batch = x.global_batch_size * case.seq
    gain = case.dynamics.advance(s, d, batch, span) - s
    return gain / (span / batch * case.clock.iteration_time(x) + switch_s)


class OracleDriver(Driver):
    """The per-interval-best reference: at every boundary, knowing the law's state, the
    strategy with the most progress per second over the next interval (its switch included).
    A reference with hindsight, not a rival."""

    def __init__(self, case: SimCase) -> None:
        self.case = case
        self.s, self.d = case.law.s0, 0.0  # the law's state, followed along the chain

    def at_boundary(self, tokens: float) -> None:
        c, now = self.case, self.executor.strategy
        self.s = c.dynamics.advance(self.s, self.d, now.global_batch_size * c.seq,
                                    tokens - self.d)
        self.d = tokens
        k = c.boundaries.index(tokens)
        span = c.boundaries[k + 1] - tokens if k + 1 < len(c.boundaries) else tokens
        best = max(c.candidates, key=lambda x: (progress_rate(
            c, self.s, tokens, span, x, c.clock.switch_time(now, x)), x.name))
        if best != now:
            self.executor.switch(best)


def run_oracle(case: SimCase) -> list[SimResult]:
    driver = OracleDriver(case)
    start = max((case.fastest(b) for b in case.batches), key=lambda x: (progress_rate(
        case, case.law.s0, 0.0, case.boundaries[1], x), x.name))
    return [run_chain(case, "oracle", {"start": start.name}, start, driver)]


def run_bound(case: SimCase) -> list[SimResult]:
    """Per target the relaxed lower bound (:func:`~megatron_cona.lawsim.bound.relaxed_bound`)
    and, with ``case.exact_bound``, the exact DP with the chains' cadence and switch costs
    (:func:`~megatron_cona.lawsim.bound.exact_bound`; with ``bound_snap`` > 0 its S rounded up
    on that grid: still a bound), with its path. The time is the tighter (larger) of the two:
    both are lower bounds."""
    names = list(case.goals)
    goals = [case.goals[n] for n in names]
    relaxed = relaxed_bound(case.dynamics, case.candidates, case.seq, case.clock.iteration_time,
                            goals, case.law.s0)
    exact = (exact_bound(case.dynamics, case.boundaries, case.candidates, case.seq,
                         case.clock.iteration_time, case.clock.switch_time, goals, case.law.s0,
                         case.bound_snap) if case.exact_bound else [None] * len(goals))
    out = []
    for name, r, bp in zip(names, relaxed, exact, strict=True):
        settings = {"target": name, "relaxed_s": r, "kind": "continuous relaxation, free switches"}
        res = SimResult("bound", settings, hits={name: r})
        if bp is not None:
            settings.update(exact_s=bp.time, snap=case.bound_snap, kind="exact DP and relaxation")
            res.hits[name] = max(r, bp.time)
            res.points = [SimPoint(d, t0, math.nan, x.name) for t0, d, x in bp.path]
            res.switches = [{"time": b[0], "from": a[2].name, "to": b[2].name}
                            for a, b in zip(bp.path, bp.path[1:], strict=False) if a[2] != b[2]]
        out.append(res)
    return out


register(Chain("planner", run_planner, "tab:gray",
               doc="fastest layout at the paper's global batch"))
register(Chain("static", run_static, "tab:brown", doc="hindsight-best static global batch"))
register(Chain("rampup", run_rampup, "tab:orange", in_bound_space=False,
               doc="Megatron --rampup-batch-size as GPT-3 did, swept, hindsight best"))
register(Chain("seesaw", run_seesaw, "tab:olive",
               doc="Seesaw: batch x2 where cosine would halve the LR, swept start"))
register(Chain("cona", run_cona, "tab:blue", rival=False, doc="CONA (real ConaSession)"))
register(Chain("oracle", run_oracle, "tab:cyan", rival=False,
               doc="per-interval best with the law's state known (the reference)"))
register(Chain("bound", run_bound, "tab:green", rival=False,
               doc="lower bounds: continuous strategy changes with free switches, and (with "
                   "--exact-variants) the exact DP with the chains' cadence and switch costs"))
