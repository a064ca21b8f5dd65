"""CONA's command-line flags, added Megatron-LM's way.

Megatron-LM users pass ``extra_args_provider=add_cona_args`` to ``pretrain(...)`` (or to
``megatron.training.arguments.parse_args``); ``megatron_cona.pretrain_gpt`` does the same.
``validate_cona_args`` turns every bad combination into a :class:`ConaArgumentError` that names
the flag.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron_cona.candidates import MAX_GLOBAL_BATCH, CandidateSpec, parse_candidate_list
from megatron_cona.lr_scaling import RULES
from predictors.flag_values import FlagValueError, parse_counts
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec

STARTS = ("smallest", "configured")  # where a CONA run starts (SessionConfig.start)


class ConaArgumentError(StrategyError):
    """A CONA or parallelism flag whose value cannot run; ``flag`` names it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def add_cona_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron-LM: adds the ``CONA`` argument group."""
    group = parser.add_argument_group(title="CONA")
    group.add_argument("--cona", action="store_true",
                       help="Enable online parallelism-strategy chaining.")
    group.add_argument("--cona-interval", type=int, default=50,
                       help="Rank candidate strategies every this many iterations.")
    group.add_argument("--cona-candidates", type=str, default="all",
                       help="'all' or a comma-separated list like dp4tp1pp1,dp2tp2pp1 "
                       "(entries may fix batches: dp2tp2pp1mb2gb16).")
    group.add_argument("--cona-min-gain", type=float, default=0.05,
                       help="Relative goodput gain the best candidate needs to be switched to.")
    group.add_argument("--cona-global-batch-range", type=str, default=None,
                       help="MIN,MAX global batch sizes CONA may use "
                       "(default: only --global-batch-size).")
    group.add_argument("--cona-micro-batches", type=str, default="1,2,4,8",
                       help="Comma-separated micro-batch sizes CONA may use.")
    group.add_argument("--cona-log", type=str, default=None,
                       help="JSON-lines file receiving every ranking decision.")
    group.add_argument("--cona-lr-scaling", type=str, default="sqrt", choices=RULES,
                       help="How the learning rate follows the global batch size.")
    group.add_argument("--cona-start", type=str, default="smallest", choices=STARTS,
                       help="smallest: start at the smallest candidate global batch on the "
                       "configured layout (the critical batch is smallest at the start; CONA "
                       "grows it from the probe's readings); configured: the job's own batch.")
    group.add_argument("--cona-patience", type=int, default=2,
                       help="Consecutive qualifying rankings before a switch.")
    group.add_argument("--cona-cooldown", type=int, default=1,
                       help="Rankings after a switch during which no switch happens.")
    group.add_argument("--cona-horizon", type=float, default=20.0,
                       help="A switch must repay its measured cost within this many intervals.")
    group.add_argument("--cona-gns-decay", type=float, default=0.95,
                       help="EMA decay of the gradient-noise-scale statistics.")
    group.add_argument("--cona-probe-bias", type=float, default=10.0,
                       help="Centre of the prior on the critical batch / the probe's noise "
                       "scale (published: ~1 to 10-100); set it where branched runs measured "
                       "it for this job.")
    group.add_argument("--cona-device", type=str, default="auto",
                       help="Device the time predictor ranks unseen strategies for "
                       "('auto' = the local one).")
    return parser


@dataclass(frozen=True)
class ConaSettings:
    candidates: CandidateSpec
    interval: int
    min_gain: float


def parse_batch_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` (or ``MIN:MAX``) global batch sizes, 1 <= MIN <= MAX <= MAX_GLOBAL_BATCH:
    ``cona plan --global-batch-range`` and ``--cona-global-batch-range``."""
    try:
        lo, hi = map(int, text.replace(":", ",").split(","))  # not two parts: a ValueError too
    except ValueError:
        raise FlagValueError(f"{text!r} is not MIN,MAX: two integers") from None
    if not 1 <= lo <= hi:
        raise FlagValueError(f"{text!r} is not MIN,MAX with 1 <= MIN <= MAX")
    if hi > MAX_GLOBAL_BATCH:
        raise FlagValueError(f"{text!r}: MAX is over {MAX_GLOBAL_BATCH:,} sequences (see "
                             "docs/cona.md)")
    return lo, hi


def precision_from_args(args: argparse.Namespace) -> str:
    """The Precision table's entry Megatron's precision flags select (``--bf16``: bf16-mixed,
    ``--fp16``: fp16-mixed, neither: the entry whose ``megatron_flag`` is empty, fp32); the
    table's ``megatron_flag`` owns the mapping, so a new entry with a flag is picked up here."""
    from predictors.spec.precision import PRECISIONS

    chosen = [n for n, p in PRECISIONS.items()
              if p.megatron_flag and getattr(args, p.megatron_flag.lstrip("-").replace("-", "_"), False)]  # fmt: skip
    if len(chosen) > 1:
        flags = " and ".join(PRECISIONS[n].megatron_flag for n in chosen)
        raise ConaArgumentError(PRECISIONS[chosen[0]].megatron_flag, f"{flags} cannot be combined")
    if chosen:
        return chosen[0]
    return next(n for n, p in PRECISIONS.items() if p.megatron_flag == "")


def static_strategy(args: argparse.Namespace, world_size: int) -> ParallelStrategy:
    """The strategy given by Megatron-LM's own parallelism and batch flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConaArgumentError(
            "--tensor-model-parallel-size",
            f"tp={tp} x pp={pp} does not divide world_size={world_size}")
    dp = world_size // (tp * pp)
    gb = args.global_batch_size if args.global_batch_size is not None else dp * args.micro_batch_size
    if gb % (dp * args.micro_batch_size):
        raise ConaArgumentError(
            "--global-batch-size",
            f"{gb} is not divisible by dp*micro_batch_size={dp}*{args.micro_batch_size}")
    return ParallelStrategy(dp, tp, pp, args.micro_batch_size, gb)


@contextmanager
def _as_flag(flag: str, *errors: type[Exception]) -> Iterator[None]:
    """An error of ``errors`` raised inside, as a ConaArgumentError naming ``flag`` (the
    parsers and checks CONA reuses name a value, not the flag it came from)."""
    try:
        yield
    except errors as err:
        raise ConaArgumentError(flag, str(err)) from None


def validate_cona_args(
    args: argparse.Namespace, world_size: int, model: TransformerSpec | None = None
) -> ConaSettings:
    """Check the CONA flags against the world and model; raise ConaArgumentError naming one."""
    start = static_strategy(args, world_size)
    with _as_flag("--tensor-model-parallel-size", StrategyError):
        start.check(world_size, model)
    if args.cona_interval < 1:
        raise ConaArgumentError("--cona-interval", f"{args.cona_interval} must be >= 1")
    if not 0 <= args.cona_min_gain < math.inf:  # nan fails it too
        raise ConaArgumentError("--cona-min-gain", f"{args.cona_min_gain} must be a finite "
                                "number >= 0")
    for flag, value in (("--cona-patience", args.cona_patience),):
        if value < 1:
            raise ConaArgumentError(flag, f"{value} must be >= 1")
    if args.cona_cooldown < 0:
        raise ConaArgumentError("--cona-cooldown", f"{args.cona_cooldown} must be >= 0")
    if not 0 < args.cona_horizon < math.inf:
        raise ConaArgumentError("--cona-horizon", f"{args.cona_horizon} must be a finite "
                                "number > 0")
    if not 0 <= args.cona_gns_decay < 1:
        raise ConaArgumentError("--cona-gns-decay", f"{args.cona_gns_decay} must be in [0, 1)")
    if not (args.cona_probe_bias > 0 and math.isfinite(args.cona_probe_bias)):
        raise ConaArgumentError("--cona-probe-bias", f"{args.cona_probe_bias} must be a "
                                "positive finite ratio")
    if args.cona_global_batch_range is None:
        lo = hi = start.global_batch_size
        if hi > MAX_GLOBAL_BATCH:  # the range's ceiling holds for the one batch CONA keeps
            raise ConaArgumentError("--global-batch-size", f"{hi} is over "
                                    f"{MAX_GLOBAL_BATCH:,} sequences, the most CONA takes "
                                    "(see docs/cona.md)")
    else:
        with _as_flag("--cona-global-batch-range", FlagValueError):
            lo, hi = parse_batch_range(args.cona_global_batch_range)
    with _as_flag("--cona-micro-batches", FlagValueError):
        micro = parse_counts(args.cona_micro_batches)
    # checked here, before Megatron builds the model: an empty path wrote no log without a
    # word, a directory failed (IsADirectoryError) and an unknown device (UnknownDeviceError)
    # only once the CONA session was built
    if args.cona_log is not None and (not args.cona_log.strip() or Path(args.cona_log).is_dir()):
        raise ConaArgumentError("--cona-log", f"{args.cona_log!r} is not a file name to write "
                                "the decisions to")
    if args.cona_device != "auto":
        from predictors.devices import UnknownDeviceError, get_device

        with _as_flag("--cona-device", UnknownDeviceError):
            get_device(args.cona_device)
    with _as_flag("--cona-candidates", StrategyError):
        spec = parse_candidate_list(args.cona_candidates)
        for layout in spec.layouts or ():
            ParallelStrategy(*layout).check(world_size, model)
        for strategy in spec.fixed:
            strategy.check(world_size, model)
    spec = CandidateSpec(layouts=spec.layouts, fixed=spec.fixed, micro_batches=micro,
                         global_batch_range=(lo, hi))
    return ConaSettings(candidates=spec, interval=args.cona_interval, min_gain=args.cona_min_gain)
