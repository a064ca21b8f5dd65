"""Learning rate that follows the global batch size when CONA changes it.

Rules (``--cona-lr-scaling``), with ``M0`` the batch the base learning rate was tuned for:
- ``sqrt`` (default, for Adam/AdamW): ``lr = lr0 * sqrt(M / M0)`` (square-root scaling keeps
  the update's noise level constant for adaptive optimizers; what Pollux uses for Adam).
- ``linear`` (SGD, Goyal et al.): ``lr = lr0 * M / M0``.
- ``adascale`` (AdaScale, Johnson et al. 2020): ``lr = lr0 * r``, with the gain
  ``r = (phi + M0) / (phi + M) * M / M0`` from the live gradient noise scale ``phi``; between
  1 (pure noise-free regime) and ``M / M0`` (noise-dominated regime).
- ``none``: keep ``lr0``.
The scheduler's warmup/decay multiplies on top of this factor.
"""

from __future__ import annotations

import math

from megatron_cona.gns import adascale_gain

RULES = ("sqrt", "linear", "adascale", "none")


class LRScalingError(ValueError):
    """Unknown rule or a non-positive batch size."""


def lr_scale(rule: str, batch: float, base_batch: float, noise_scale: float = math.nan) -> float:
    """Multiplier on the base learning rate for global batch ``batch``."""
    if batch <= 0 or base_batch <= 0:
        raise LRScalingError(f"batch={batch}, base_batch={base_batch} must be > 0")
    if rule == "sqrt":
        return math.sqrt(batch / base_batch)
    if rule == "linear":
        return batch / base_batch
    if rule == "adascale":
        return adascale_gain(noise_scale, batch, base_batch)
    if rule == "none":
        return 1.0
    raise LRScalingError(f"--cona-lr-scaling={rule!r} is unknown; choose one of {', '.join(RULES)}")


def apply_lr_scale(scheduler, base_lr: float, base_min_lr: float, scale: float) -> None:
    """Set a megatron ``OptimizerParamScheduler``'s peak and floor LR to ``scale`` times the base
    ones and push the result into the optimizer (warmup/decay keep their sample-based shape).
    The one place any CONA loop changes the learning rate."""
    scheduler.max_lr = base_lr * scale
    scheduler.min_lr = base_min_lr * scale
    scheduler.step(increment=0)
