"""``predict collect``'s integer lists (--seqs, --batches, --dp) and counts (--repeats,
--threads, --passes), and ``predict memory``'s --batch and --image-res: parsed by the shared
:mod:`predictors.flag_values`, each value >= 1 (and, in a list, each once), refused naming the
flag before any work; an unknown --models name is refused the same way. Nothing is measured or
priced here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from predictors.cli import build_parser, main
from predictors.flag_values import FlagValueError, parse_count, parse_counts
from predictors.time.collect import model_zoo

COUNT_FLAGS = ("--seqs", "--batches", "--dp")
COUNT_FLAG = ("--repeats", "--threads", "--passes")


def _refused(argv: list[str], capsys) -> str:
    """argparse's refusal of ``argv``: exit status 1 (as every error of ``predict``: 2 is
    ``predict memory``'s oom), and its last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 1
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_collect_takes_count_lists_and_its_defaults():
    args = build_parser().parse_args(["collect", "--seqs", "64", "--batches", " 2, 8 ,"])
    assert (args.seqs, args.batches, args.dp) == ((64,), (2, 8), (1, 2))
    defaults = build_parser().parse_args(["collect"])
    assert (defaults.seqs, defaults.batches, defaults.dp) == ((32, 128), (1, 4), (1, 2))


@pytest.mark.parametrize("flag", COUNT_FLAGS)
@pytest.mark.parametrize("text, says", [
    ("32,32", "lists a value twice"),
    ("0,4", "must list integers >= 1"),
    ("-1", "must list integers >= 1"),
    (",", "must list integers >= 1"),
    ("1:4", "is not a comma-separated list of integers"),
])
def test_collect_refuses_a_bad_count_list_naming_the_flag(flag, text, says, capsys):
    """A repeat put its points in the grid twice (measured twice per pass, two rows each); a 0
    batch or DP size went on to the measurement, a 0 sequence length failed naming the model's
    seq_length, not the flag; '1:4' was argparse's bare "invalid _ints value"."""
    with pytest.raises(FlagValueError) as parsed:
        parse_counts(text)
    assert says in str(parsed.value)
    assert _refused(["collect", flag, text], capsys) == (
        f"predict collect: error: argument {flag}: {parsed.value}")


def test_collect_takes_counts_and_its_defaults():
    args = build_parser().parse_args(["collect", "--repeats", "3", "--threads", " 2 ",
                                      "--passes", "4"])
    assert (args.repeats, args.threads, args.passes) == (3, 2, 4)
    defaults = build_parser().parse_args(["collect"])
    assert (defaults.repeats, defaults.threads, defaults.passes) == (5, 1, 1)


@pytest.mark.parametrize("flag", COUNT_FLAG)
@pytest.mark.parametrize("text", ["0", "-1", "2.5", "two", ""])
def test_collect_refuses_a_count_below_one_naming_the_flag(flag, text, capsys):
    """With ``type=int``, 0 or fewer repeats crashed (IndexError) after the first point's
    warm-up steps, 0 or fewer threads crashed in torch's set_num_threads, and 0 or fewer passes
    measured nothing and exited 0; '2.5' was argparse's bare "invalid int value"."""
    with pytest.raises(FlagValueError) as parsed:
        parse_count(text)
    assert str(parsed.value) == f"{text!r} is not an integer >= 1"
    assert _refused(["collect", flag, text], capsys) == (
        f"predict collect: error: argument {flag}: {parsed.value}")


@pytest.mark.parametrize("text", ["0", "-5", "inf", "nan", "soon"])
def test_collect_refuses_a_time_budget_that_is_no_amount(text, capsys):
    """``--minutes 0`` (or a negative) measured nothing and exited 0, saying the budget was
    reached."""
    assert _refused(["collect", "--minutes", text], capsys) == (
        f"predict collect: error: argument --minutes: {text!r} is not a positive finite number")
    assert build_parser().parse_args(["collect", "--minutes", "0.5"]).minutes == 0.5


@pytest.mark.parametrize("models, says", [
    ("nope", "'nope' unknown"),
    ("gpt-s,gtp-m,vit-xs,bert", "'gtp-m', 'bert' unknown"),
    (",", "names no model"),
])
def test_collect_refuses_an_unknown_model_before_measuring(models, says, tmp_path, capsys):
    """An unknown zoo name was dropped from the grid: alone ('nope') it left an empty grid that
    measured nothing and exited 0; beside known names the typo went unnoticed."""
    out = tmp_path / "m.csv"
    assert main(["collect", "--out", str(out), "--precisions", "fp32", "--models", models]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"predict collect: error: --models {models!r}: {says}; choose zoo names "
                   f"from {', '.join(model_zoo(32))}")
    assert list(tmp_path.iterdir()) == []  # refused before any file is written


def test_collect_measures_the_known_models_named_with_blanks(tmp_path, monkeypatch, capsys):
    import predictors.time.collect as collect_module

    measured = []
    monkeypatch.setattr(collect_module, "collect",
                        lambda out, points, **kw: measured.extend(points) or out)
    assert main(["collect", "--out", str(tmp_path / "m.csv"), "--precisions", "fp32",
                 "--models", "gpt-xs, vit-xs,"]) == 0
    assert {p.model for p in measured} == {"gpt-xs", "vit-xs"}


@pytest.mark.parametrize("argv", [
    ["--model", "mlp", "--batch", "0"],
    ["--model", "cnn", "--batch", "-1"],
    ["--model", "llava-1.5-7b-like", "--image-res", "0"],
    ["--model", "llava-1.5-7b-like", "--image-res", "-336"],
])
def test_memory_refuses_a_batch_or_resolution_below_one_naming_the_flag(argv, capsys):
    """With ``type=int``, ``--model mlp --batch 0`` priced a step of no samples (verdict FITS,
    exit 0), ``--batch -1`` crashed in torch (negative dimension), and a preset took
    ``--image-res 0`` or ``-336`` (multiples of its patch size) and priced a model at it."""
    flag, text = argv[-2:]
    with pytest.raises(FlagValueError) as parsed:
        parse_count(text)
    assert _refused(["memory", *argv], capsys) == (
        f"predict memory: error: argument {flag}: {parsed.value}")


def test_memory_takes_a_batch_and_a_resolution():
    args = build_parser().parse_args(["memory", "--model", "llava-1.5-7b-like", "--batch", "4",
                                      "--image-res", "448"])
    assert (args.batch, args.image_res) == (4, 448)
    defaults = build_parser().parse_args(["memory", "--model", "mlp"])
    # None: not given (predict memory refuses --batch beside --strategy, then takes 1)
    assert (defaults.batch, defaults.image_res) == (None, None)


def _status(argv: list[str]) -> int:
    """``predict``'s exit status for ``argv``, whether main returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


MLP = ["memory", "--model", "mlp", "--hidden", "64", "--input", "64"]


@pytest.mark.parametrize("argv, says", [
    (["memory", "--model", "mlp", "--framework", "ddp"],
     "predict memory: error: argument --framework: invalid choice: 'ddp'"),
    (["memory", "--batch", "4"], "predict memory: error: the following arguments are required: "
     "--model"),
    (["memroy", "--model", "mlp"], "predict: error: argument command: invalid choice: 'memroy'"),
    (["time", "--bogus"], "predict: error: unrecognized arguments: --bogus"),
    (["time", "--precision", "bf17"], "predict time: error: precision='bf17' is unknown"),
    (["time", "--strategy", "dp0"], "predict time: error: "),
    (["time", "--device", "tpu9"], "predict time: error: device='tpu9' is unknown"),
    ([*MLP, "--precision", "bf17"], "error: UnknownPrecisionError: precision='bf17' is unknown"),
    ([*MLP, "--seq", "512"], "error: ModelSpecError: --seq: the model 'mlp' has no sequence"),
    (["memory", "--model", "llama-7b-like", "--optimizer", "sgd"],
     "error: ModelSpecError: --optimizer 'sgd': the analytical model"),
])
def test_every_error_of_predict_exits_1_so_that_2_only_means_oom(argv, says, capsys):
    """argparse's usage errors exited 2, and so did main's named errors (an unknown precision,
    device or strategy), while predict memory's refusals exited 1: a script that skips a job on
    2, predict memory's oom, read a typo or an unknown precision as oom."""
    assert _status(argv) == 1
    assert says in capsys.readouterr().err


def test_an_oom_verdict_still_exits_2(capsys):
    assert _status(["memory", "--model", "mlp", "--hidden", "4096,4096", "--input", "4096",
                    "--batch", "4096", "--capacity-gib", "1.6", "--device", "a100-40gb"]) == 2
    assert "verdict: OOM" in capsys.readouterr().out


def test_predict_memory_help_gives_the_exit_status_table(capsys):
    assert _status(["memory", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("exit status: 0 fits, 3 tight (the margin straddles the usable capacity), 2 oom; 1 "
            "any error") in help_text


def test_the_predictors_cli_imports_no_plugin():
    """The shared parsers live in predictors because CONA imports predictors, never the
    reverse: ``predict`` must run where megatron_cona is not importable."""
    code = ("import sys, predictors.cli, predictors.flag_values; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron_cona', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_the_grid_refuses_an_unknown_model_from_python_too():
    """``default_grid``'s Python callers (the benchmarks) get the command line's refusal: a
    name not in the zoo was dropped without a word."""
    from predictors.spec.model import UnknownModelError
    from predictors.time.collect import default_grid

    assert {p.model for p in default_grid(["fp32"], models=["gpt-xs"])} == {"gpt-xs"}
    with pytest.raises(UnknownModelError, match=r"models=\('gpt-xs', 'nope'\): 'nope' unknown; "
                       "choose zoo names from .*gpt-xs"):
        default_grid(["fp32"], models=["gpt-xs", "nope"])
    with pytest.raises(UnknownModelError, match="names no model"):
        default_grid(["fp32"], models=[])
