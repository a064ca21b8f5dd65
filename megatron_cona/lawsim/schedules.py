"""The batch schedules of the rivals that follow a fixed schedule (pure functions): Megatron's
ramp-up as GPT-3 used it, and Seesaw."""

from __future__ import annotations

import math


def rampup_batch(tokens: float, seq: int, start: int, final: int, ramp_tokens: float) -> int:
    """Megatron's ``--rampup-batch-size START START RAMP_SAMPLES`` to ``final``: the batch grows
    by START every ``RAMP_SAMPLES / ((final - START) / START)`` samples consumed."""
    increments = (final - start) // start
    if increments <= 0 or tokens >= ramp_tokens:
        return final
    per = ramp_tokens / seq / increments
    return min(final, start + start * int(tokens / seq // per))


def seesaw_batch(tokens: float, start: int, budget_tokens: float, cap: int) -> int:
    """Seesaw (Meterez et al. 2025): wherever cosine decay over ``budget_tokens`` would halve
    the learning rate, double the batch instead (LR x 1/sqrt 2, which the law's tuned LR
    absorbs); cosine reaches 1/2^k of its peak at x_k = arccos(2^(1-k) - 1) / pi."""
    x = min(tokens / budget_tokens, 1.0)
    lr = 0.5 * (1.0 + math.cos(math.pi * x))
    halvings = int(math.floor(-math.log2(max(lr, 1e-12)) + 1e-12))
    return min(cap, start * 2 ** halvings)
