"""Sanity checks of the law-based simulator, printed before any result, each with its source.
A check compares the simulator with a published statement; it is never tuned to it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_cona.lawsim.constants import value
from megatron_cona.lawsim.law import LossCriticalBatch, ModelLaw, kaplan_bcrit
from megatron_cona.lawsim.schedules import seesaw_batch


@dataclass(frozen=True)
class Check:
    name: str
    source: str
    expected: str
    got: str
    passed: bool

    def line(self) -> str:
        return (f"[{'PASS' if self.passed else 'FAIL'}] {self.name}: expected {self.expected}, "
                f"simulator {self.got} ({self.source})")


def _gpt_law(params: float) -> ModelLaw:
    return ModelLaw("kaplan", params, value("B_star"))


def critical_batch_identity(params: float = 1.2e9, losses: tuple[float, float] = (3.6, 3.4),
                            intervals: int = 200) -> Check:
    """At a constant batch B = E_min / S_min a run takes 2 S_min steps and 2 E_min tokens
    (McCandlish et al. 2018, Eq 2.11-2.12). The simulator is stepped interval by interval (its
    chains' path), S_min and E_min are its B -> inf and B -> 0 limits."""
    dyn = LossCriticalBatch(_gpt_law(params), value("B_star"))
    s1, s2 = dyn.law.s_min(losses[0]), dyn.law.s_min(losses[1])
    s_min, e_min = s2 - s1, dyn.e_min(s1, s2)
    batch = e_min / s_min
    tokens = dyn.tokens_to(s1, 0.0, batch, s2)
    step, s, walked = tokens / intervals, s1, 0.0
    while dyn.advance(s, walked, batch, step) < s2:  # the chains' interval-by-interval path
        s, walked = dyn.advance(s, walked, batch, step), walked + step
    walked += dyn.tokens_to(s, walked, batch, s2)
    steps = walked / batch
    ok = math.isclose(steps, 2 * s_min, rel_tol=1e-3) and math.isclose(walked, 2 * e_min,
                                                                       rel_tol=1e-3)
    return Check("constant batch at B_crit", "McCandlish et al. 2018, Eq 2.11-2.12",
                 "2 S_min steps, 2 E_min tokens",
                 f"{steps / s_min:.4f} S_min steps, {walked / e_min:.4f} E_min tokens "
                 f"(B = {batch:.3g} tokens, loss {losses[0]} -> {losses[1]})", ok)


def doubling_per_loss_drop() -> Check:
    """Under Kaplan's constants B_crit doubles for each ~13% loss decrease (Eq 5.3)."""
    drop = 1.0 - 2.0 ** (-value("alpha_B"))
    ratio = kaplan_bcrit(3.0 * (1 - drop), 1.0) / kaplan_bcrit(3.0, 1.0)
    want = value("bcrit_doubling_loss_drop")
    ok = abs(drop - want) <= 0.01 and math.isclose(ratio, 2.0, rel_tol=1e-9)
    return Check("B_crit doubling per loss decrease", "Kaplan et al. 2020, Eq 5.3",
                 f"~{100 * want:.0f}%", f"{100 * drop:.1f}% (B_crit x{ratio:.3f})", ok)


def seesaw_saving(sizes: tuple[float, ...] = (150e6, 300e6, 600e6)) -> Check:
    """Seesaw's setup (Meterez et al. 2025): 150M/300M/600M models at Chinchilla scale (20
    tokens per parameter), a constant critical batch under cosine decay vs Seesaw (batch x2
    where cosine would halve the LR): serial steps to the baseline's final loss. The constant
    batch is the law's critical batch at that final loss (a fixed point). Passes when the
    simulated saving is within half to one and a half times the published ~36%."""
    published, savings = 0.36, []
    for n in sizes:
        dyn = LossCriticalBatch(_gpt_law(n), value("B_star"))
        budget = value("tokens_per_param") * n
        batch = 1e6
        for _ in range(50):  # B0 = B_crit(final loss of the run at B0)
            end = dyn.advance(dyn.law.s0, 0.0, batch, budget)
            batch = kaplan_bcrit(dyn.law.loss(end), dyn.b_star)
        end = dyn.advance(dyn.law.s0, 0.0, batch, budget)
        base_steps = budget / batch
        s, d, steps, pieces = dyn.law.s0, 0.0, 0.0, 400
        for _ in range(pieces * 4):  # Seesaw until the baseline's loss (or 4x the budget)
            b = seesaw_batch(d, 1, budget, 1 << 30) * batch
            chunk = budget / pieces
            nxt = dyn.advance(s, d, b, chunk)
            if nxt >= end:
                steps += dyn.tokens_to(s, d, b, end) / b
                break
            s, d, steps = nxt, d + chunk, steps + chunk / b
        savings.append(1.0 - steps / base_steps)
    got = sum(savings) / len(savings)
    return Check("Seesaw serial-step saving", "Meterez et al. 2025 (Seesaw), ~36% less "
                 "wall-clock at equal FLOPs", f"~{100 * published:.0f}%",
                 f"{100 * got:.1f}% fewer serial steps (mean of "
                 f"{', '.join(f'{100 * x:.1f}%' for x in savings)}; difference "
                 f"{100 * (got - published):+.1f} points)",
                 0.5 * published <= got <= 1.5 * published)


CHECKS = (critical_batch_identity, doubling_per_loss_drop, seesaw_saving)


def run_checks() -> list[Check]:
    return [check() for check in CHECKS]
