"""How a :class:`~megatron_cona.session.ConaSession` acts on a job: the :class:`Executor`
protocol, what a switch returns (:class:`SwitchOutcome`) or raises (:class:`SwitchUnsupported`),
and :class:`ExecutorBase`, what every real executor shares: rank 0's choice agreed on every
rank, the base learning rate captured from the scheduler once, and the LR scale applied
through the one LR rule (:func:`~megatron_cona.lr_scaling.apply_lr_scale`). Subclasses say how
a switch happens (``strategy`` and ``switch``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from megatron_cona.lr_scaling import BaseLR, apply_lr_scale
from predictors.spec import ParallelStrategy


class SwitchUnsupported(RuntimeError):
    """The executor cannot perform this kind of switch; the message says why."""


@dataclass
class SwitchOutcome:
    switched: bool
    seconds: float  # cost of the switch (measured, or charged by a simulated clock)
    moved_tensors: bool = False
    error: str | None = None  # why a switch was rolled back


class Executor(Protocol):
    """How a session acts on a training job."""

    @property
    def strategy(self) -> ParallelStrategy:
        """The strategy running now."""

    def agree(self, strategy: ParallelStrategy) -> ParallelStrategy:
        """The same choice on every rank (rank 0's)."""

    def why_not(self, target: ParallelStrategy) -> str | None:
        """Why this executor cannot switch from the running strategy to ``target`` (None: it
        can): the session decides among what it can reach and names the rest as a
        recommendation."""

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        """Run ``target`` from now on (layout and/or micro/global batch); raises
        :class:`SwitchUnsupported` (with :meth:`why_not`'s reason) when this executor
        cannot."""

    def set_lr_scale(self, scale: float) -> None:
        """Scale the base peak/floor learning rate by ``scale``."""

    def lr_factor(self) -> float:
        """The LR schedule's share of the peak now (warmup and decay; 1 without a schedule),
        the same whatever the batch rule scaled: what the progress check divides a rate by."""


class SingleProcessExecutor:
    """Base of the executors of a simulated cluster: one process decides, and each switch is
    charged later by the simulation (``pending``: (old, new, cost) per switch)."""

    def __init__(self, start: ParallelStrategy) -> None:
        self._strategy = start
        self.pending: list[tuple[ParallelStrategy, ParallelStrategy, float]] = []

    @property
    def strategy(self) -> ParallelStrategy:
        return self._strategy

    def why_not(self, target: ParallelStrategy) -> str | None:
        return None  # a simulated cluster runs any candidate

    def agree(self, strategy: ParallelStrategy) -> ParallelStrategy:
        return strategy  # one process decides

    def lr_factor(self) -> float:
        return 1.0  # a simulated job's LR follows no schedule (the laws assume it tuned)


def schedule_factor(scheduler) -> float:
    """A megatron ``OptimizerParamScheduler``'s LR now over its peak (warmup and decay), read
    from its first param group: the same for every group and whatever scale
    :func:`~megatron_cona.lr_scaling.apply_lr_scale` set, which scales peak and floor
    together. Read here, not in ``lr_scaling``: that module shapes the law check's committed
    curves (``benchmarks/cona_curves.py``'s code hash), and reading the LR changes none."""
    group = scheduler.optimizer.param_groups[0]
    peak = group.get("max_lr") or scheduler.max_lr
    return scheduler.get_lr(group) / peak if peak > 0 else 1.0


class ExecutorBase:
    """Subclasses provide ``scheduler`` (the live megatron ``OptimizerParamScheduler``) and call
    :meth:`capture_lr` once it exists."""

    scheduler: object

    def capture_lr(self) -> None:
        """The configured peak/floor LRs every later scale multiplies (read once, at start)."""
        self.base_lr = BaseLR(self.scheduler)

    def why_not(self, target: ParallelStrategy) -> str | None:
        return None  # what a subclass cannot do, it says

    def agree(self, strategy: ParallelStrategy) -> ParallelStrategy:
        """Rank 0's choice, on every rank."""
        box = [strategy.name]
        dist.broadcast_object_list(box, src=0)
        return ParallelStrategy.parse(box[0])

    def set_lr_scale(self, scale: float) -> None:
        apply_lr_scale(self.scheduler, self.base_lr, scale)

    def lr_factor(self) -> float:
        return schedule_factor(self.scheduler)
