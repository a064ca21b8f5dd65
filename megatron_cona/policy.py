"""When to switch strategy: only when the best candidate's goodput beats the running one's by
``min_gain`` AND the time lost to the switch is repaid within a horizon, for ``patience``
rankings in a row (hysteresis against noise), and not again within ``cooldown`` rankings of the
last switch. Every decision is logged with the numbers it was made from."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_cona.goodput import GoodputEstimate
from predictors.spec import ParallelStrategy

log = logging.getLogger("megatron_cona.policy")


class PolicyError(ValueError):
    """Invalid policy parameters."""


@dataclass(frozen=True)
class PolicyConfig:
    min_gain: float = 0.05  # relative goodput improvement required
    horizon_intervals: float = 20.0  # switch cost must be repaid within this many intervals
    patience: int = 2  # consecutive qualifying rankings before switching
    cooldown: int = 1  # rankings after a switch during which no switch happens

    def __post_init__(self) -> None:
        if self.min_gain < 0:
            raise PolicyError(f"min_gain={self.min_gain} must be >= 0")
        if self.horizon_intervals <= 0:
            raise PolicyError(f"horizon_intervals={self.horizon_intervals} must be > 0")
        if self.patience < 1:
            raise PolicyError(f"patience={self.patience} must be >= 1")
        if self.cooldown < 0:
            raise PolicyError(f"cooldown={self.cooldown} must be >= 0")


@dataclass
class SwitchCostModel:
    """Seconds lost to a switch: measured switches (EMA) replace the priors."""

    # a (DP, TP, PP) change: a new layout's state is built and weights + optimizer state move
    # (for_build raises it to the job's own state build where that is longer)
    layout_prior_s: float = 1.0
    batch_prior_s: float = 0.01  # micro/global batch only: no tensor moves
    decay: float = 0.5
    _measured: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_build(cls, build_seconds: float | None) -> SwitchCostModel:
        """The model for a job whose training state took ``build_seconds`` to build (None: not
        timed). A layout switch builds the new layout's state the same way and also plans,
        moves the state and makes process groups, so the build is a floor of its cost: the
        prior is the larger of the two, never below the default (a cheap build would price the
        first switch by its least part)."""
        prior = cls.layout_prior_s
        return cls(layout_prior_s=prior if build_seconds is None else max(prior, build_seconds))

    @staticmethod
    def kind(current: ParallelStrategy, target: ParallelStrategy) -> str:
        return "layout" if current.layout != target.layout else "batch"

    def estimate(self, current: ParallelStrategy, target: ParallelStrategy) -> float:
        kind = self.kind(current, target)
        prior = self.layout_prior_s if kind == "layout" else self.batch_prior_s
        return self._measured.get(kind, prior)

    def measured(self, current: ParallelStrategy, target: ParallelStrategy) -> bool:
        """Whether a switch of this kind was made (its estimate is no longer the prior)."""
        return self.kind(current, target) in self._measured

    def record(self, current: ParallelStrategy, target: ParallelStrategy, seconds: float) -> None:
        kind = self.kind(current, target)
        old = self._measured.get(kind)
        self._measured[kind] = seconds if old is None else (
            self.decay * old + (1 - self.decay) * seconds)


@dataclass(frozen=True)
class Decision:
    iteration: int
    current: GoodputEstimate
    best: GoodputEstimate
    gain: float  # best.goodput / current.goodput - 1
    switch_cost_s: float
    payback_s: float  # training time after which the switch has paid for itself
    horizon_s: float
    streak: int
    switch: bool
    reason: str
    noise_scale: float = math.nan
    top: tuple[GoodputEstimate, ...] = ()

    @property
    def target(self) -> ParallelStrategy:
        return self.best.strategy if self.switch else self.current.strategy

    def as_dict(self) -> dict:
        return {
            "iteration": self.iteration, "switch": self.switch, "reason": self.reason,
            "current": self.current.as_dict(), "best": self.best.as_dict(),
            "gain": self.gain, "switch_cost_s": self.switch_cost_s,
            "payback_s": self.payback_s, "horizon_s": self.horizon_s, "streak": self.streak,
            "noise_scale": self.noise_scale, "top": [e.as_dict() for e in self.top],
        }


def payback_time(current_goodput: float, best_goodput: float, cost_s: float) -> float:
    """Time ``t`` with ``best * (t - cost) = current * t``: after it, the switch is ahead."""
    if best_goodput <= current_goodput:
        return math.inf
    return cost_s * best_goodput / (best_goodput - current_goodput)


class SwitchPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig(),
                 costs: SwitchCostModel | None = None) -> None:
        self.config = config
        self.costs = costs or SwitchCostModel()
        self._streak = 0
        self._since_switch = math.inf

    def decide(
        self,
        iteration: int,
        current: GoodputEstimate,
        ranking: list[GoodputEstimate],
        interval_s: float,
        noise_scale: float = math.nan,
        gain_low: float = math.nan,
        must_leave: str | None = None,
        hold: str | None = None,
    ) -> Decision:
        """``ranking`` best first; ``interval_s`` the running strategy's time per interval;
        ``gain_low`` the best candidate's gain at the pessimistic end of the noise scale's
        measured uncertainty (nan: none measured): the switch must win there too.
        ``must_leave``: why the running strategy has to be left now (the best of ``ranking``
        is taken whatever its gain, cooldown and patience aside). ``hold``: why the running
        strategy must be kept now (no switch, whatever the ranking)."""
        cfg = self.config
        if hold:
            self._streak = 0
            self._since_switch += 1
            return Decision(iteration, current, current, 0.0, 0.0, math.inf,
                            cfg.horizon_intervals * interval_s, 0, False, hold, noise_scale,
                            tuple(ranking[:5]))
        if must_leave and ranking:
            self._streak, self._since_switch = 0, 0
            best = ranking[0]
            cost = self.costs.estimate(current.strategy, best.strategy)
            return Decision(iteration, current, best, best.goodput / current.goodput - 1.0,
                            cost, payback_time(current.goodput, best.goodput, cost),
                            cfg.horizon_intervals * interval_s, 0, True, must_leave,
                            noise_scale, tuple(ranking[:5]))
        best = ranking[0] if ranking and ranking[0].goodput > current.goodput else current
        gain = best.goodput / current.goodput - 1.0
        if best is not current and not math.isnan(gain_low):
            gain = min(gain, gain_low)
        cost = self.costs.estimate(current.strategy, best.strategy) if best is not current else 0.0
        payback = payback_time(current.goodput, best.goodput, cost)
        horizon = cfg.horizon_intervals * interval_s
        self._since_switch += 1
        # a predicted (not yet measured) time must win by its expected error on top
        required = cfg.min_gain + best.uncertainty
        qualifies = best is not current and gain >= required and payback <= horizon
        self._streak = self._streak + 1 if qualifies else 0
        if best is current:
            reason = "current strategy is the best candidate"
        elif gain < required:
            reason = (f"gain {gain:.3f} (worst within the noise scale's uncertainty) < "
                      f"min_gain {cfg.min_gain} + prediction uncertainty {best.uncertainty:.3f}")
        elif payback > horizon:
            reason = f"switch cost {cost:.3f}s repaid after {payback:.1f}s > horizon {horizon:.1f}s"
        elif self._since_switch <= cfg.cooldown:
            reason = f"cooldown: {self._since_switch} ranking(s) since last switch"
        elif self._streak < cfg.patience:
            reason = f"qualifies {self._streak}/{cfg.patience} rankings in a row"
        else:
            reason = "switch"
        switch = reason == "switch"
        if switch:
            self._streak = 0
            self._since_switch = 0
        return Decision(iteration, current, best, gain, cost, payback, horizon, self._streak,
                        switch, reason, noise_scale, tuple(ranking[:5]))


class DecisionLog:
    """Writes each decision as a JSON line (``--cona-log``) and to the logger."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, decision: Decision, **extra: object) -> None:
        log.info(
            "iter %d %s -> %s: goodput %.3g vs %.3g (gain %+.1f%%), cost %.3fs, payback %.1fs "
            "(horizon %.1fs), phi=%.1f: %s",
            decision.iteration, decision.current.strategy.name, decision.best.strategy.name,
            decision.best.goodput, decision.current.goodput, 100 * decision.gain,
            decision.switch_cost_s, decision.payback_s, decision.horizon_s,
            decision.noise_scale, decision.reason,
        )
        if self.path:
            with self.path.open("a") as fh:
                fh.write(json.dumps({**decision.as_dict(), **extra}, default=str) + "\n")
