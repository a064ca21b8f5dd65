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


# what makes megatron-core's param groups distinct (``_get_param_groups``): groups of one key
# get the same configured LR whatever the layout, so a rebuilt optimizer's groups find theirs
GROUP_KEY = ("wd_mult", "lr_mult", "is_decoupled_lr", "is_expert_parallel")


class BaseLR:
    """A megatron ``OptimizerParamScheduler``'s peak and floor LR as the job configured them,
    and each kind of optimizer param group's own ``max_lr`` / ``min_lr``: megatron-core's
    ``get_lr`` reads a group's own values before the scheduler's, so a scale applied to the
    scheduler alone never reaches a group that carries them."""

    def __init__(self, scheduler) -> None:
        self.max_lr, self.min_lr = scheduler.max_lr, scheduler.min_lr
        self.groups: dict[tuple, tuple[float | None, float | None]] = {}
        self.learn(scheduler.optimizer.param_groups)

    def learn(self, groups) -> None:
        """Record the configured LRs of kinds of group not seen yet (a switch rebuilds the
        optimizer, and a pipeline stage may hold kinds of parameters another did not)."""
        for group in groups:
            self.groups.setdefault(_group_key(group),
                                   (group.get("max_lr"), group.get("min_lr")))


def _group_key(group: dict) -> tuple:
    return tuple(group.get(k) for k in GROUP_KEY)


def apply_lr_scale(scheduler, base: BaseLR, scale: float) -> None:
    """Set a megatron ``OptimizerParamScheduler``'s peak and floor LR, and every param group's
    own, to ``scale`` times the configured ones and push the result into the optimizer
    (warmup/decay keep their sample-based shape). The one place any CONA loop changes the
    learning rate."""
    scheduler.max_lr = base.max_lr * scale
    scheduler.min_lr = base.min_lr * scale
    groups = scheduler.optimizer.param_groups
    base.learn(groups)  # a rebuilt optimizer's groups carry the configured (unscaled) LRs
    for group in groups:
        max_lr, min_lr = base.groups[_group_key(group)]
        if max_lr is not None:
            group["max_lr"] = max_lr * scale
        if min_lr is not None:
            group["min_lr"] = min_lr * scale
    scheduler.step(increment=0)
