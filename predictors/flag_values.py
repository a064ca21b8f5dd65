"""Integer flags, parsed one way for every command line that takes them: the comma-separated
lists of ``predict collect``, ``cona plan``, ``cona scale``, ``--cona-micro-batches``,
``benchmarks/cona_grid.py --seeds`` and ``benchmarks/bench_ttft.py --suffix-lengths``, and the
single counts (``predict collect --repeats``, ``predict memory --batch``, ...); the lists'
rule is checked by one function, :func:`check_distinct`, for the flags and for the dataclasses
that Python callers build directly (``CandidateSpec``, ``SimOptions``).

It lives in ``predictors`` for the reason :mod:`predictors.image_path` does: CONA imports from
``predictors`` and never the reverse, so ``predict`` cannot import these from ``megatron_cona``.
It imports only argparse (no torch: ``cona``'s flags are parsed before any model loads).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


class FlagValueError(ValueError):
    """A list or range flag's text that cannot be taken; the message names the text, and each
    caller adds its own flag (argparse's error through :func:`flag_type`, ``cona run``'s
    ``ConaArgumentError``)."""


def parse_ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers (blanks between commas skipped), not checked further: for
    lists whose values their consumer checks (``cona scale``'s, by ``SimOptions``)."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:  # argparse would say only "invalid ... value"
        raise FlagValueError(f"{text!r} is not a comma-separated list of integers") from None


def check_once(values: Sequence[Hashable], field: str, *,
               error: type[ValueError] = FlagValueError) -> None:
    """Each of ``values`` once, else ``error`` naming ``field`` (the caller's name for the values
    as its message shows them: ``micro_batches=(1, 1)``, a flag's text ``'1,1'``). Such a list
    is taken as a set, so a repeat is a typo, and where each value is run, it would run twice."""
    if len(set(values)) != len(values):
        raise error(f"{field} lists a value twice")


def check_distinct(values: Sequence[int], field: str, least: int = 1, *,
                   error: type[ValueError] = FlagValueError) -> tuple[int, ...]:
    """``values`` as a tuple: at least one, each >= ``least`` and each once (the rule of every
    list of counts or sizes, from a flag or a dataclass); else ``error`` naming ``field`` as
    :func:`check_once` does (dataclasses raise their own error type)."""
    if not values or min(values) < least:
        raise error(f"{field} must list integers >= {least}")
    check_once(values, field, error=error)
    return tuple(values)


def parse_distinct(text: str, least: int) -> tuple[int, ...]:
    """Comma-separated integers, at least one, each >= ``least`` and each once."""
    return check_distinct(parse_ints(text), repr(text), least)


def parse_counts(text: str) -> tuple[int, ...]:
    """Comma-separated counts or sizes (micro-batch sizes, sequence lengths, data-parallel
    sizes): at least one, each >= 1 and each once."""
    return parse_distinct(text, 1)


def parse_count(text: str) -> int:
    """One count or size (repeats, threads, a batch, a token count): an integer >= 1 (argparse's
    ``type=int`` took 0 and negatives, which reached the work as an empty loop, a crash or a
    model of nothing)."""
    try:
        if (value := int(text)) >= 1:
            return value
    except ValueError:  # not an integer: argparse would say only "invalid ... value"
        pass
    raise FlagValueError(f"{text!r} is not an integer >= 1")


def parse_positive(text: str) -> float:
    """A positive finite real (a time budget, a noise scale): 0, a negative, inf or nan is no
    amount (a 0-minute budget measured nothing and exited 0)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # also false for nan
        raise FlagValueError(f"{text!r} is not a positive finite number")
    return value


def flag_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` of a parser that raises :class:`FlagValueError`: argparse prints an
    ArgumentTypeError's message after the flag (of a plain ValueError only "invalid <name>
    value")."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except FlagValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__
    return convert
