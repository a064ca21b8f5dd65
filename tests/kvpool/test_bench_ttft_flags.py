"""benchmarks/bench_ttft.py's flags, parsed by its ``parser()`` alone (the benchmark never
runs here, so no engine is needed): the suffix lengths through the shared
:func:`predictors.flag_values.parse_counts`, the counts and sizes through
:func:`~predictors.flag_values.parse_count`, each refused naming the flag."""

from __future__ import annotations

import pytest

from predictors.flag_values import FlagValueError, parse_count, parse_counts
from tests.bench_module import load_benchmark

COUNTS = ("--prefix-tokens", "--layers", "--chunk-tokens", "--reps")


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("bench_ttft")
    return module


def _refusal(bench, argv: list[str], capsys) -> str:
    """argparse's last stderr line without its program name (sys.argv[0], pytest's here)."""
    with pytest.raises(SystemExit) as exc:
        bench.parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1].partition(": ")[2]


def test_the_defaults_and_a_list_parse(bench):
    args = bench.parser().parse_args([])
    assert (args.suffix_lengths, args.prefix_tokens, args.layers, args.chunk_tokens,
            args.reps) == ((256, 2048), 8192, 16, 256, 3)
    args = bench.parser().parse_args(["--suffix-lengths", "16, 48", "--reps", "1"])
    assert (args.suffix_lengths, args.reps) == ((16, 48), 1)


@pytest.mark.parametrize("text, says", [
    ("64,64", "lists a value twice"),
    ("0,64", "must list integers >= 1"),
    ("-64", "must list integers >= 1"),
    (",", "must list integers >= 1"),
    ("64;256", "is not a comma-separated list of integers"),
])
def test_a_bad_suffix_length_list_is_refused_naming_the_flag(bench, text, says, capsys):
    """The lambda took a repeat (each length ran twice per repetition, both in one median),
    left 0 and negatives to a check in main (untestable without running the benchmark), and
    '64;256' was argparse's bare "invalid <lambda> value"."""
    with pytest.raises(FlagValueError) as parsed:
        parse_counts(text)
    assert says in str(parsed.value)
    err = _refusal(bench, ["--suffix-lengths", text], capsys)
    assert err == f"error: argument --suffix-lengths: {parsed.value}"


@pytest.mark.parametrize("flag", COUNTS)
@pytest.mark.parametrize("text", ["0", "-256", "1.5"])
def test_a_count_below_one_is_refused_naming_the_flag(bench, flag, text, capsys):
    """With ``type=int`` a 0 --chunk-tokens divided by zero in main's multiple-of check, and a
    0 or negative --prefix-tokens or --chunk-tokens passed it (0 % 256 == 0, -256 % 256 == 0)."""
    with pytest.raises(FlagValueError) as parsed:
        parse_count(text)
    err = _refusal(bench, [flag, text], capsys)
    assert err == f"error: argument {flag}: {parsed.value}"
