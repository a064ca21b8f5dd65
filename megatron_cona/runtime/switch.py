"""The atomic, checkpoint-free strategy switch of a CONA training state.

``switch_strategy(state, new_strategy)`` (collective over the default world) returns a
:class:`SwitchResult` whose ``state`` is the one to keep training with:

* same (DP, TP, PP), other micro/global batch: only the strategy, the micro-batch calculator
  and the data position bookkeeping change — no tensor moves, no rebuild;
* otherwise: build the new layout's groups, model, DDP buffers and optimizer (no weight init),
  move weights, fp32 main weights, Adam moments and scalar optimizer state with
  :func:`megatron_cona.reshard.transfer_state` (planned from the global shapes and both layouts'
  shards, streamed in buckets over the process group), carry iteration, consumed samples and
  gradient hooks, reseed the RNG tracker for the new layout, destroy the old layout's groups.

Atomicity: every phase that can fail locally (validate, build, plan, each transfer bucket,
finalize) ends with a vote on the world group.  If any rank failed, every rank discards the new
state (its groups destroyed), restores the RNG streams and micro-batch calculator of the old
one, logs each failing rank's cause and returns ``switched=False`` with the old state, which no
phase ever writes.  Failures *inside* a collective (a dead rank, a broken link) cannot be voted
on; they surface as the process group's timeout, as for any collective in training.

Memory: until the commit both layouts' states are alive (the old one is the rollback), so the
extra memory of a switch is the new layout's state on this rank plus at most ``bucket_bytes`` of
transfer buffers (send copies + receive buffers) at any time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_cona.grad_probe import device as _device
from megatron_cona.parallel import build_groups
from megatron_cona.reshard.transfer import DEFAULT_BUCKET_BYTES, transfer_state
from megatron_cona.runtime.state import TrainState, activate, build_state, configure_microbatches
from predictors.spec import ParallelStrategy

logger = logging.getLogger("megatron_cona.reshard")


class SwitchAborted(RuntimeError):
    """Raised inside the protocol when a vote found a failed rank (never escapes)."""


@dataclass
class SwitchResult:
    state: TrainState  # continue training with this one
    switched: bool
    old_strategy: ParallelStrategy
    new_strategy: ParallelStrategy
    moved_tensors: bool = False
    seconds: float = 0.0
    bytes_sent: int = 0  # remote bytes this rank sent
    bytes_total: int = 0  # remote bytes of the whole plan
    num_buckets: int = 0
    peak_buffer_bytes: int = 0  # this rank's largest bucket (send + receive buffers)
    error: str | None = None  # why the switch was rolled back
    phase_seconds: dict[str, float] = field(default_factory=dict)  # build / plan / transfer / ...


def _vote(error: BaseException | None) -> None:
    """Collective: raise SwitchAborted on every rank if any rank passed an error."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    causes: list = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(causes, mine)
    raise SwitchAborted("; ".join(f"rank {r}: {c}" for r, c in enumerate(causes) if c))


def _phase(name: str, on_phase: Callable[[str], None] | None, body: Callable[[], object],
           collective: bool = False):
    """Run a phase body, then vote; returns the body's value on every rank.

    A ``collective`` body (one that calls collectives) is entered only after a vote that every
    rank is ready, so a rank failing before it cannot leave its peers blocked inside it."""
    error, value = None, None
    try:
        if on_phase is not None:
            on_phase(name)
    except Exception as exc:  # noqa: BLE001 - reported through the vote
        error = exc
    if collective:
        _vote(error)
    try:
        if error is None:
            value = body()
    except Exception as exc:  # noqa: BLE001 - reported through the vote
        error = exc
        logger.debug("phase %s failed locally", name, exc_info=True)
    _vote(error)
    return value


def switch_strategy(state: TrainState, new_strategy: ParallelStrategy, *,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    on_phase: Callable[[str], None] | None = None) -> SwitchResult:
    """Switch ``state`` to ``new_strategy`` in memory (see module doc).  Collective.

    ``on_phase(name)`` is called on every rank at the start of each phase (``validate``,
    ``build``, ``plan``, ``transfer:<bucket>``, ``finalize``); an exception raised there counts as
    that rank failing the phase (used by tests to inject failures, or for progress)."""
    start = time.perf_counter()
    old = state
    result = SwitchResult(old, False, old.strategy, new_strategy)
    rng = _rng_snapshot()
    new_state: TrainState | None = None
    holder: dict = {}  # filled by the build phase even on ranks whose peers failed it
    try:
        _phase("validate", on_phase, lambda: _validate(old, new_strategy, bucket_bytes))
        if new_strategy.layout == old.strategy.layout:
            _phase("finalize", on_phase, lambda: _change_batch(old, new_strategy))
            result.switched = True
            result.seconds = time.perf_counter() - start
            return result
        clock = _Clock(result.phase_seconds)
        _phase("build", on_phase, lambda: holder.update(state=_build(old, new_strategy)),
               collective=True)
        new_state = holder["state"]
        clock.lap("build")

        def phase(name, body, collective=False):
            if name == "finalize":
                clock.lap("transfer")  # the buckets ran since the plan
            value = _phase(name, on_phase, body, collective)
            clock.lap(name.split(":")[0])
            return value

        stats = transfer_state(
            old, new_state, bucket_bytes=bucket_bytes, phase=phase, vote=_vote,
            on_bucket=None if on_phase is None else (lambda i: on_phase(f"transfer:{i}")))
        new_state.iteration, new_state.consumed_samples = old.iteration, old.consumed_samples
        new_state.pre_reduction_hooks = list(old.pre_reduction_hooks)
    except SwitchAborted as abort:
        _rollback(old, new_state or holder.get("state"), rng)
        result.error = str(abort)
        result.seconds = time.perf_counter() - start
        logger.warning("strategy switch %s -> %s rolled back: %s", old.strategy.name,
                       new_strategy.name, abort)
        return result
    old.destroy()
    activate(new_state)
    result.state, result.switched, result.moved_tensors = new_state, True, True
    result.bytes_sent, result.bytes_total = stats.bytes_sent, stats.bytes_total
    result.num_buckets, result.peak_buffer_bytes = stats.num_buckets, stats.peak_buffer_bytes
    result.seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        logger.info("switched %s -> %s in %.3fs (%s): %d buckets, %.1f MiB moved",
                    old.strategy.name, new_strategy.name, result.seconds,
                    ", ".join(f"{k} {v:.3f}s" for k, v in result.phase_seconds.items()),
                    result.num_buckets, result.bytes_total / 2**20)
    return result


class _Clock:
    def __init__(self, laps: dict[str, float]) -> None:
        self.laps, self.last = laps, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = self.laps.get(name, 0.0) + now - self.last, now


def _validate(old: TrainState, new: ParallelStrategy, bucket_bytes: int) -> None:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    new.check(dist.get_world_size(), old.config.model)


def _change_batch(state: TrainState, new: ParallelStrategy) -> None:
    configure_microbatches(new, state.consumed_samples)
    state.strategy = new


def _build(old: TrainState, new: ParallelStrategy) -> TrainState:
    groups = build_groups(new)
    try:
        return build_state(old.config, new, iteration=old.iteration,
                           consumed_samples=old.consumed_samples, initialize=False,
                           groups=groups, activate_now=False)
    except Exception:
        groups.destroy()
        raise


def _rng_snapshot():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _rollback(old: TrainState, new: TrainState | None, rng) -> None:
    if new is not None:
        new.destroy()
    cpu, cuda, tracker = rng
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_cuda_rng_tracker().set_states(tracker)
    configure_microbatches(old.strategy, old.consumed_samples)
