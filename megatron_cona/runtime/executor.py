"""How a :class:`~megatron_cona.session.ConaSession` acts on the CONA runtime: switches run the
transactional in-memory reshard (:func:`~megatron_cona.runtime.switch.switch_strategy`), the
learning rate follows through the one LR rule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cona.executor import ExecutorBase, SwitchOutcome
from megatron_cona.runtime.state import TrainState
from megatron_cona.runtime.switch import DEFAULT_BUCKET_BYTES, switch_strategy
from predictors.spec import ParallelStrategy


def max_over_world(seconds: float) -> float:
    """The slowest rank's time (an iteration or a switch is as slow as its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class RuntimeExecutor(ExecutorBase):
    """Owns the running :class:`TrainState`; ``state`` changes when a switch commits. A layout
    switch builds a new optimizer and scheduler from the job's config, so the LRs captured at
    start stay the configured ones and the session's next scale applies to the new pair."""

    def __init__(self, state: TrainState, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.state = state
        self.bucket_bytes = bucket_bytes
        self.capture_lr()

    @property
    def scheduler(self):
        return self.state.scheduler

    @property
    def strategy(self) -> ParallelStrategy:
        return self.state.strategy

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        result = switch_strategy(self.state, target, bucket_bytes=self.bucket_bytes)
        self.state = result.state
        return SwitchOutcome(result.switched, max_over_world(result.seconds),
                             result.moved_tensors, result.error)
