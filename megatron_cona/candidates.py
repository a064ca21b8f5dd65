"""Candidate strategies: every (DP, TP, PP) layout the world and model admit, times micro- and
global-batch sizes, minus those predicted not to fit device memory (each drop logged)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from predictors.flag_values import check_distinct, check_once
from predictors.spec import (
    DEFAULT_OPTIONS,
    ParallelStrategy,
    StrategyError,
    TrainingOptions,
    TransformerSpec,
)

if TYPE_CHECKING:  # only an annotation here: the module imports torch, `cona plan`'s flags need none
    from predictors.spec.precision import Precision

log = logging.getLogger("megatron_cona.candidates")

Layout = tuple[int, int, int]


class MemoryModel(Protocol):
    """Peak device memory of one rank for ``strategy`` (bytes)."""

    def peak_bytes(
        self, model: TransformerSpec, strategy: ParallelStrategy, precision: Precision
    ) -> float: ...


@dataclass(frozen=True)
class Rejected:
    strategy: ParallelStrategy
    reason: str


@dataclass
class CandidateSet:
    kept: list[ParallelStrategy] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.kept)

    def __iter__(self):
        return iter(self.kept)


@dataclass(frozen=True)
class CandidateSpec:
    """What the user asked for: ``--cona-candidates`` entries and the batch ranges."""

    layouts: tuple[Layout, ...] | None = None  # None = every admissible layout
    fixed: tuple[ParallelStrategy, ...] = ()  # entries that also named mb/gb: taken as is
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    global_batch_range: tuple[int, int] = (1, 1 << 30)
    batch_grid: str = "pow2"  # "pow2": global batches dp*mb*2^k; "all": every multiple

    def __post_init__(self) -> None:
        # The command lines refuse these in their own words first (parse_counts,
        # parse_batch_range, parse_candidate_list, SimOptions); Python callers build the spec
        # directly. A 0 micro-batch was a ZeroDivisionError and a negative one never returned
        # (global_batches' loop); a repeat was taken silently (an inadmissible layout reported
        # once per repeat); a range with MIN < 1 was taken as MIN 1, MAX < MIN left no candidate.
        check_distinct(self.micro_batches, f"micro_batches={self.micro_batches}",
                       error=StrategyError)
        for name in ("layouts", "fixed"):
            values = getattr(self, name) or ()
            check_once(values, f"{name}={values}", error=StrategyError)
        span = self.global_batch_range
        if len(span) != 2 or not 1 <= span[0] <= span[1]:
            raise StrategyError(f"global_batch_range={span} must be (MIN, MAX) with "
                                "1 <= MIN <= MAX")


# The most GPUs a plan or simulation takes: about a million, beyond any cluster built;
# divisors() loops sqrt(world) times (a world of 10^30 never returned).
MAX_WORLD = 2**20
# The largest global batch (sequences) a candidate range may reach: published runs use ~10^4;
# a range to 10^30 ranked thousands of candidates of 10^26 ms per iteration.
MAX_GLOBAL_BATCH = 2**20


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found up to its square root (``range(1, n +
    1)`` took minutes for a world of 10^9)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def admissible_layouts(world_size: int, model: TransformerSpec) -> list[Layout]:
    """(dp, tp, pp) with dp*tp*pp == world_size that ``model`` admits."""
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            try:
                ParallelStrategy(dp, tp, pp).check(world_size, model)
            except StrategyError:
                continue
            out.append((dp, tp, pp))
    return sorted(out)


_ENTRY = re.compile(r"^dp\d+tp\d+pp\d+(mb\d+)?(gb\d+)?$")


def parse_candidate_list(text: str) -> CandidateSpec:
    """``all`` or comma-separated ``dp4tp1pp1,dp2tp2pp1mb2gb16``; raises StrategyError, whose
    message the caller prefixes with its flag (``--candidates``, ``--cona-candidates``)."""
    text = text.strip().lower()
    if text == "all":
        return CandidateSpec()
    layouts: list[Layout] = []
    fixed: list[ParallelStrategy] = []
    seen: dict[object, str] = {}  # a layout or a fixed strategy -> the entry that gave it
    for entry in filter(None, (e.strip() for e in text.split(","))):
        if not _ENTRY.match(entry):
            raise StrategyError(f"entry {entry!r} is not 'all' or dp<D>tp<T>pp<P>[mb<M>][gb<G>]")
        try:
            strategy = ParallelStrategy.parse(entry)
        except StrategyError as err:
            raise StrategyError(f"entry {entry!r}: {err}") from None
        is_fixed = "mb" in entry or "gb" in entry
        key = strategy if is_fixed else strategy.layout
        # a repeat is a typo: the list is taken as a set, and an inadmissible one was reported
        # once per repeat
        if key in seen:
            same = "" if seen[key] == entry else f" (the same as {seen[key]!r})"
            raise StrategyError(f"entry {entry!r} is listed twice{same}")
        seen[key] = entry
        if is_fixed:
            fixed.append(strategy)
        else:
            layouts.append(strategy.layout)
    if not layouts and not fixed:
        raise StrategyError("empty: give 'all' or dp<D>tp<T>pp<P>[mb<M>][gb<G>] entries")
    return CandidateSpec(layouts=tuple(layouts), fixed=tuple(fixed))


def global_batches(dp: int, micro: int, lo: int, hi: int, grid: str) -> list[int]:
    step = dp * micro
    first = max(step, -(-lo // step) * step)
    if grid == "all":
        return list(range(first, hi + 1, step))
    if grid != "pow2":
        raise StrategyError(f"batch_grid={grid!r} must be 'pow2' or 'all'")
    out, k = [], 1
    while step * k <= hi:
        if step * k >= lo:
            out.append(step * k)
        k *= 2
    return out


def _batched(layouts: Iterable[Layout], spec: CandidateSpec) -> list[ParallelStrategy]:
    lo, hi = spec.global_batch_range
    out = []
    for dp, tp, pp in layouts:
        for mb in spec.micro_batches:
            for gb in global_batches(dp, mb, lo, hi, spec.batch_grid):
                out.append(ParallelStrategy(dp, tp, pp, mb, gb))
    return out


def enumerate_candidates(
    world_size: int,
    model: TransformerSpec,
    spec: CandidateSpec = CandidateSpec(),
    *,
    precision: Precision | None = None,
    memory_model: MemoryModel | None = None,
    memory_limit_bytes: float | None = None,
) -> CandidateSet:
    """All candidates for ``world_size`` and ``model``; rejected ones keep their reason."""
    result = CandidateSet()
    admissible = set(admissible_layouts(world_size, model))
    wanted = spec.layouts if spec.layouts is not None else tuple(sorted(admissible))
    for layout in wanted:
        if layout not in admissible:
            try:
                ParallelStrategy(*layout).check(world_size, model)
                reason = "layout not admissible"
            except StrategyError as err:
                reason = str(err)
            result.rejected.append(Rejected(ParallelStrategy(*layout), reason))
    proposals = _batched((lay for lay in sorted(set(wanted)) if lay in admissible), spec)
    for strategy in spec.fixed:
        try:
            strategy.check(world_size, model)
        except StrategyError as err:
            result.rejected.append(Rejected(strategy, str(err)))
            continue
        proposals.append(strategy)
    for strategy in dict.fromkeys(proposals):
        reason = _memory_reason(model, strategy, precision, memory_model, memory_limit_bytes)
        if reason:
            result.rejected.append(Rejected(strategy, reason))
        else:
            result.kept.append(strategy)
    for rej in result.rejected:
        log.info("candidate %s dropped: %s", rej.strategy.name, rej.reason)
    if not result.kept:
        raise StrategyError(
            f"no candidate strategy remains for world_size={world_size} "
            f"({len(result.rejected)} rejected; first: "
            f"{result.rejected[0].reason if result.rejected else 'none proposed'})"
        )
    return result


def _memory_reason(
    model: TransformerSpec,
    strategy: ParallelStrategy,
    precision: Precision | None,
    memory_model: MemoryModel | None,
    limit: float | None,
) -> str | None:
    if memory_model is None or limit is None or precision is None:
        return None
    peak = memory_model.peak_bytes(model, strategy, precision)
    if peak > limit:
        return f"predicted peak memory {peak / 2**30:.2f} GiB > limit {limit / 2**30:.2f} GiB"
    return None


class PredictorMemory:
    """Peak memory of one rank from the multimodal memory predictor of ``predictors.memory``.

    Per rank, in Megatron-Core's layout (``predict_peak_memory(strategy=)``): the pipeline
    stage with the largest device total, each stage its own layers (a GELU tower as the
    SwiGLU layer with its MLP's parameter count), weights/gradients/states split ``tp`` ways,
    activations per Megatron's TP split and held for ``min(pp - stage, micro-batches)``
    micro-batches in flight (1F1B) beside the schedule's received and kept gradients, the
    micro-batch as the batch; the CUDA context is per process, not divided by ``tp``, and
    NCCL's buffers are one communicator's per group of more than one rank a rank uses (dp,
    tp, pp, and Megatron-LM's world, model-parallel, distributed-optimizer and, on the first
    and last stage, embedding groups; ``predictors.memory.device.nccl_communicators``).
    Under Megatron's options (the
    default) Megatron-Core's gradient buffer is held, full size, in every phase (fp32 at bf16
    weights; ``predictors.memory.device.grad_buffers``).
    """

    def __init__(self, capacity_gib: float | str = 80, architecture: str | None = None,
                 options: TrainingOptions | None = None) -> None:
        """``architecture``: the GPU generation (``"hopper"`` / ``"pre-hopper"``, its CUDA
        context and allocator overheads); ``options``: the job's distributed optimizer / FSDP
        and recompute, which change what a rank holds."""
        self.capacity_gib = capacity_gib
        self.architecture = architecture
        self.options = options

    def peak_bytes(self, model: TransformerSpec, strategy: ParallelStrategy,
                   precision: Precision) -> float:
        from predictors.memory.api import predict_peak_memory

        return predict_peak_memory(model, strategy, self.options or DEFAULT_OPTIONS, precision,
                                   self.capacity_gib,
                                   architecture=self.architecture).device_total
