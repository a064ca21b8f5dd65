"""What every real :class:`~megatron_cona.session.Executor` shares: rank 0's choice agreed on
every rank, the base learning rate captured from the scheduler once, and the LR scale applied
through the one LR rule (:func:`~megatron_cona.lr_scaling.apply_lr_scale`). Subclasses say how
a switch happens (``strategy`` and ``switch``)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_cona.lr_scaling import apply_lr_scale
from predictors.spec import ParallelStrategy


class ExecutorBase:
    """Subclasses provide ``scheduler`` (the live megatron ``OptimizerParamScheduler``) and call
    :meth:`capture_lr` once it exists."""

    scheduler: object

    def capture_lr(self) -> None:
        """The base peak/floor LR every later scale multiplies (read once, at start)."""
        self.base_lr, self.base_min_lr = self.scheduler.max_lr, self.scheduler.min_lr

    def agree(self, strategy: ParallelStrategy) -> ParallelStrategy:
        """Rank 0's choice, on every rank."""
        box = [strategy.name]
        dist.broadcast_object_list(box, src=0)
        return ParallelStrategy.parse(box[0])

    def set_lr_scale(self, scale: float) -> None:
        apply_lr_scale(self.scheduler, self.base_lr, self.base_min_lr, scale)
