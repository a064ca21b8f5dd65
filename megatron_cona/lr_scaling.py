"""Learning rate that follows the global batch size when CONA (or any simulated chain) changes it.

Rules (``--cona-lr-scaling``), with ``M0`` the batch the base learning rate was tuned for:
- ``sqrt`` (default, for Adam/AdamW): ``lr = lr0 * sqrt(M / M0)`` (square-root scaling keeps
  the update's noise level constant for adaptive optimizers; what Pollux uses for Adam).
- ``linear`` (SGD, Goyal et al.): ``lr = lr0 * M / M0``.
- ``adascale`` (AdaScale, Johnson et al. 2020): ``lr = lr0 * r``, with the gain
  ``r = (phi + M0) / (phi + M) * M / M0`` from the live gradient noise scale ``phi``; between
  1 (pure noise-free regime) and ``M / M0`` (noise-dominated regime).
- ``none``: keep ``lr0``.
- a per-batch table (:class:`TableLR`): ``lr = table[M]``, e.g. tuned by one sweep per batch.
The scheduler's warmup/decay multiplies on top of this factor.

:class:`BatchLR` is the one object every chain asks for its learning rate (the simulation and
the law check give every chain the same one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_cona.gns import adascale_gain

RULES = ("sqrt", "linear", "adascale", "none")


class LRScalingError(ValueError):
    """Unknown rule, a non-positive batch size or a batch the table does not hold."""


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


@dataclass(frozen=True)
class BatchLR:
    """The learning rate of every global batch: ``base_lr`` (tuned at ``base_batch``) times a
    rule's multiplier, or a per-batch ``table`` when given (the rule is then ``table``)."""

    base_lr: float
    base_batch: int
    rule: str = "sqrt"
    table: Mapping[int, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.base_lr <= 0 or self.base_batch <= 0:
            raise LRScalingError(f"base_lr={self.base_lr}, base_batch={self.base_batch} must be "
                                 "> 0")
        if self.rule == "table":
            if not self.table:
                raise LRScalingError("rule='table' needs a non-empty table")
        elif self.rule not in RULES:
            raise LRScalingError(f"rule={self.rule!r} is unknown; choose one of "
                                 f"{', '.join(RULES)}, table")

    @classmethod
    def from_table(cls, table: Mapping[int, float], base_batch: int) -> BatchLR:
        if base_batch not in table:
            raise LRScalingError(f"base_batch={base_batch} is not in the LR table {dict(table)}")
        return cls(table[base_batch], base_batch, "table", dict(table))

    def lr(self, batch: int, noise_scale: float = math.nan) -> float:
        return self.base_lr * self.scale(batch, noise_scale)

    def scale(self, batch: int, noise_scale: float = math.nan) -> float:
        """Multiplier on ``base_lr`` at global batch ``batch``."""
        if self.rule == "table":
            return self._table_lr(batch) / self.base_lr
        return lr_scale(self.rule, batch, self.base_batch, noise_scale)

    def _table_lr(self, batch: int) -> float:
        """The table's LR; between two tabled batches (e.g. a ramp-up's 48) geometric
        interpolation in the batch, beyond the table its edge value."""
        if batch <= 0:
            raise LRScalingError(f"batch={batch} must be > 0")
        if batch in self.table:
            return self.table[batch]
        keys = sorted(self.table)
        if batch < keys[0] or batch > keys[-1]:
            return self.table[keys[0] if batch < keys[0] else keys[-1]]
        hi = next(k for k in keys if k > batch)
        lo = max(k for k in keys if k < batch)
        w = math.log(batch / lo) / math.log(hi / lo)
        return math.exp((1 - w) * math.log(self.table[lo]) + w * math.log(self.table[hi]))

    @property
    def name(self) -> str:
        return "table" if self.rule == "table" else f"{self.rule}@{self.base_batch}"


def apply_lr_scale(scheduler, base_lr: float, base_min_lr: float, scale: float) -> None:
    """Set a megatron ``OptimizerParamScheduler``'s peak and floor LR to ``scale`` times the base
    ones and push the result into the optimizer (warmup/decay keep their sample-based shape).
    The one place any CONA loop changes the learning rate."""
    scheduler.max_lr = base_lr * scale
    scheduler.min_lr = base_min_lr * scale
    scheduler.step(increment=0)
