"""``predict collect``'s integer lists (--seqs, --batches, --dp): parsed by the shared
:mod:`predictors.flag_values`, each value >= 1 and each once, refused naming the flag before any
measurement. Only the parser runs here: no point is measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from predictors.cli import build_parser
from predictors.flag_values import FlagValueError, parse_counts

COUNT_FLAGS = ("--seqs", "--batches", "--dp")


def test_collect_takes_count_lists_and_its_defaults():
    args = build_parser().parse_args(["collect", "--seqs", "64", "--batches", " 2, 8 ,"])
    assert (args.seqs, args.batches, args.dp) == ((64,), (2, 8), (1, 2))
    defaults = build_parser().parse_args(["collect"])
    assert (defaults.seqs, defaults.batches, defaults.dp) == ((32, 128), (1, 4), (1, 2))


@pytest.mark.parametrize("flag", COUNT_FLAGS)
@pytest.mark.parametrize("text, says", [
    ("32,32", "lists a value twice"),
    ("0,4", "is not a comma-separated list of integers >= 1"),
    ("-1", "is not a comma-separated list of integers >= 1"),
    (",", "is not a comma-separated list of integers >= 1"),
    ("1:4", "is not a comma-separated list of integers"),
])
def test_collect_refuses_a_bad_count_list_naming_the_flag(flag, text, says, capsys):
    """A repeat put its points in the grid twice (measured twice per pass, two rows each); a 0
    batch or DP size went on to the measurement, a 0 sequence length failed naming the model's
    seq_length, not the flag; '1:4' was argparse's bare "invalid _ints value"."""
    with pytest.raises(FlagValueError) as parsed:
        parse_counts(text)
    assert says in str(parsed.value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["collect", flag, text])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert err[-1] == f"predict collect: error: argument {flag}: {parsed.value}"


def test_the_predictors_cli_imports_no_plugin():
    """The shared parsers live in predictors because CONA imports predictors, never the
    reverse: ``predict`` must run where megatron_cona is not importable."""
    code = ("import sys, predictors.cli, predictors.flag_values; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron_cona', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
