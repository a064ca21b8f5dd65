import argparse
import sys

import pytest

from megatron_cona.arguments import (
    ConaArgumentError,
    add_cona_args,
    parse_batch_range,
    validate_cona_args,
)
from megatron_cona.candidates import MAX_GLOBAL_BATCH
from megatron_cona.pretrain_gpt import parse_args
from predictors.flag_values import FlagValueError, parse_counts
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec

GPT = TransformerSpec("gpt", 4, 64, 4, 32, 257)


def megatron_parse(argv):
    """How Megatron-LM's parse_args uses an extra_args_provider."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser = add_cona_args(parser)
    return parser.parse_args(argv)


def test_flags_parse_megatron_way():
    args = megatron_parse(["--cona", "--cona-interval", "10", "--cona-candidates",
                           "dp4tp1pp1,dp2tp2pp1", "--cona-min-gain", "0.2",
                           "--cona-global-batch-range", "8,64", "--cona-log", "x.jsonl",
                           "--micro-batch-size", "1", "--global-batch-size", "8"])
    assert args.cona and args.cona_interval == 10 and args.cona_min_gain == 0.2
    settings = validate_cona_args(args, world_size=4, model=GPT)
    assert settings.candidates.layouts == ((4, 1, 1), (2, 2, 1))
    assert settings.candidates.global_batch_range == (8, 64)
    defaults = megatron_parse([])
    assert not defaults.cona and defaults.cona_candidates == "all"
    with pytest.raises(SystemExit):  # Megatron-LM disables abbreviations
        megatron_parse(["--cona-int", "3"])


def test_pretrain_gpt_parser_has_megatron_names_and_defaults():
    args = parse_args([], extra_args_provider=add_cona_args)
    assert args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    assert args.micro_batch_size is None or args.micro_batch_size >= 1
    assert args.clip_grad == 1.0 and args.adam_beta2 == 0.999 and args.seed == 1234
    assert args.weight_decay == 0.01 and args.init_method_std == 0.02
    assert not args.cona


@pytest.mark.parametrize(
    "argv, world, flag",
    [
        (["--cona-candidates", "dp3tp1pp1"], 4, "--cona-candidates"),
        (["--cona-candidates", "dp2tp2pp1mb2gb6"], 4, "--cona-candidates"),
        (["--cona-candidates", "dp1tp4pp1"], 4, "--cona-candidates"),  # heads=4 ok, hidden 64 ok
        (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size"),
        (["--micro-batch-size", "2", "--global-batch-size", "6"], 4, "--global-batch-size"),
        (["--cona-interval", "0"], 4, "--cona-interval"),
        (["--cona-min-gain", "-0.1"], 4, "--cona-min-gain"),
        (["--cona-candidates", "tp2"], 4, "--cona-candidates"),
        (["--cona-probe-bias", "0"], 4, "--cona-probe-bias"),
        (["--cona-probe-bias", "nan"], 4, "--cona-probe-bias"),
        (["--cona-min-gain", "nan"], 4, "--cona-min-gain"),
        (["--cona-horizon", "nan"], 4, "--cona-horizon"),
        (["--cona-horizon", "inf"], 4, "--cona-horizon"),
        (["--cona-candidates", "dp4tp1pp1,dp2tp2pp1,dp4tp1pp1"], 4, "--cona-candidates"),
        (["--cona-log", ""], 4, "--cona-log"),
        (["--cona-log", "."], 4, "--cona-log"),
        (["--cona-device", "a100-80"], 4, "--cona-device"),
    ],
)
def test_bad_flags_named(argv, world, flag):
    args = megatron_parse(["--cona", "--micro-batch-size", "1", "--global-batch-size", "8",
                           *argv])
    if argv == ["--cona-candidates", "dp1tp4pp1"]:
        assert validate_cona_args(args, world, GPT)  # admissible: control case
        return
    with pytest.raises(ConaArgumentError) as err:
        validate_cona_args(args, world, GPT)
    assert err.value.flag == flag and str(err.value).startswith(flag)
    assert isinstance(err.value, StrategyError)


@pytest.mark.parametrize("text, taken", [
    ("8,64", (8, 64)), ("8:64", (8, 64)), (" 8 , 64 ", (8, 64)), ("8,8", (8, 8)),
    (f"1,{MAX_GLOBAL_BATCH}", (1, MAX_GLOBAL_BATCH)),
])
def test_batch_range_taken(text, taken):
    assert parse_batch_range(text) == taken


@pytest.mark.parametrize("text, says", [
    ("eight", "is not MIN,MAX: two integers"), ("8", "is not MIN,MAX: two integers"),
    ("8,16,32", "is not MIN,MAX: two integers"), ("8,,64", "is not MIN,MAX: two integers"),
    ("8,64,", "is not MIN,MAX: two integers"), ("0,5", "is not MIN,MAX with 1 <= MIN <= MAX"),
    ("-8,5", "is not MIN,MAX with 1 <= MIN <= MAX"),
    ("64,8", "is not MIN,MAX with 1 <= MIN <= MAX"),
    (f"8,{MAX_GLOBAL_BATCH + 1}", f"MAX is over {MAX_GLOBAL_BATCH:,} sequences"),
    (f"8,{10**30}", f"MAX is over {MAX_GLOBAL_BATCH:,} sequences"),
])
def test_batch_range_refused_naming_the_value(text, says):
    """The one parser of a MIN,MAX global-batch range (``cona plan --global-batch-range``,
    ``--cona-global-batch-range``): 'eight' was an argparse "invalid _batch_range value" on
    cona plan; '8,,64' and '8,64,' ran on cona run as 8,64; a range to 10^30 ranked thousands
    of candidates of 10^26 ms per iteration (each command refused it in its own words)."""
    with pytest.raises(FlagValueError) as err:
        parse_batch_range(text)
    assert str(err.value).startswith(repr(text)) and says in str(err.value)


@pytest.mark.parametrize("text, taken", [("1,2,4", (1, 2, 4)), (" 8, 1 ,", (8, 1))])
def test_counts_taken(text, taken):
    assert parse_counts(text) == taken


@pytest.mark.parametrize("text, says", [
    ("1,2,1", "lists a value twice"), ("0,-1", "must list integers >= 1"),
    (",", "must list integers >= 1"),
    ("1:2", "is not a comma-separated list of integers"),
    ("two", "is not a comma-separated list of integers"),
])
def test_counts_refused_naming_the_value(text, says):
    """The one parser of a list of counts (``cona plan --micro-batches``,
    ``--cona-micro-batches``): each >= 1, each once. A 0 was a ZeroDivisionError on cona plan,
    a repeat ran as if listed once; '1:2' was two micro-batches on cona run (':' separates a
    range's ends: 1:8 is no list of 1 and 8)."""
    with pytest.raises(FlagValueError) as err:
        parse_counts(text)
    assert str(err.value).startswith(repr(text)) and says in str(err.value)


@pytest.mark.parametrize("flag, text, parse", [
    ("--cona-global-batch-range", "64,8", parse_batch_range),
    ("--cona-micro-batches", "1,2,1", parse_counts),
])
def test_cona_run_names_the_flag_of_a_shared_parsers_refusal(flag, text, parse):
    args = megatron_parse(["--cona", "--micro-batch-size", "1", "--global-batch-size", "8",
                           flag, text])
    with pytest.raises(FlagValueError) as parsed:
        parse(text)
    with pytest.raises(ConaArgumentError) as err:
        validate_cona_args(args, 4, GPT)
    assert err.value.flag == flag and str(err.value) == f"{flag}: {parsed.value}"


@pytest.mark.parametrize("flag, text, parse", [
    ("--global-batch-range", "64,8", parse_batch_range),
    ("--micro-batches", "1,2,1", parse_counts),
])
def test_cona_plan_names_the_flag_of_a_shared_parsers_refusal(flag, text, parse, capsys):
    from megatron_cona.cli import main

    with pytest.raises(FlagValueError) as parsed:
        parse(text)
    with pytest.raises(SystemExit) as exc:
        main([*PLAN, flag, text])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1] == f"cona plan: error: argument {flag}: {parsed.value}"


def test_a_global_batch_size_over_the_ceiling_without_a_range_names_its_flag():
    """With no --cona-global-batch-range CONA keeps --global-batch-size, under the same
    ceiling; its refusal named --cona-global-batch-range, a flag not given."""
    args = megatron_parse(["--cona", "--micro-batch-size", "1",
                           "--global-batch-size", str(4 * MAX_GLOBAL_BATCH)])
    with pytest.raises(ConaArgumentError) as err:
        validate_cona_args(args, 4, GPT)
    assert err.value.flag == "--global-batch-size"
    assert str(err.value).startswith(f"--global-batch-size: {4 * MAX_GLOBAL_BATCH} is over")


def test_cona_log_and_device_that_can_run_are_taken(tmp_path):
    """The control for the refusals above: a new file in a new folder, a known device."""
    args = megatron_parse(["--cona", "--micro-batch-size", "1", "--global-batch-size", "8",
                           "--cona-log", str(tmp_path / "new" / "cona.jsonl"),
                           "--cona-device", "h100-80gb", "--cona-micro-batches", "1,2"])
    assert validate_cona_args(args, 4, GPT).candidates.micro_batches == (1, 2)


def test_static_strategy_from_megatron_flags():
    from megatron_cona.arguments import static_strategy

    args = megatron_parse(["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                           "--global-batch-size", "16"])
    assert static_strategy(args, 4) == ParallelStrategy(2, 2, 1, 2, 16)


def test_cli_errors_are_one_named_line(capsys):
    from megatron_cona.cli import main

    rc = main(["plan", "--world", "6", "--num-layers", "4", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--candidates", "dp4tp1pp1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith("cona plan: error: StrategyError") and "world_size=6" in err
    rc = main(["plot", "--log", "no-such-run.jsonl", "--out", "x.png"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "no-such-run.jsonl" in err


@pytest.mark.parametrize("candidates, says", [
    ("dp4tp1pp1,dp4tp1pp1", "entry 'dp4tp1pp1' is listed twice"),
    ("dp4tp1pp1mb1gb8, DP4TP1PP1GB8", "entry 'dp4tp1pp1gb8' is listed twice (the same as "
     "'dp4tp1pp1mb1gb8')"),
    ("dp4tp1pp1,dp4tp1pp1mb0gb8", "entry 'dp4tp1pp1mb0gb8': micro_batch=0"),
    ("dp4tp1", "entry 'dp4tp1' is not"),
    (",", "empty"),
])
def test_cli_plan_candidates_name_the_flag_and_the_entry(capsys, candidates, says):
    """``cona plan --candidates dp4tp1pp1,dp4tp1pp1`` ran as if listed once; its other errors
    named `cona run`'s --cona-candidates, or (a zero micro-batch) no flag and no entry."""
    from megatron_cona.cli import main

    rc = main(["plan", "--world", "4", "--num-layers", "4", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--candidates", candidates])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith(f"cona plan: error: StrategyError: --candidates: {says}")


def test_cli_run_without_gpu_points_to_cpu_launcher(capsys):
    import torch

    from megatron_cona.cli import main

    if torch.cuda.is_available():
        pytest.skip("GPU present: `cona run` trains directly")
    assert main(["run", "--num-layers", "2"]) == 2
    assert "scripts/cona_cpu.py pretrain" in capsys.readouterr().err


def test_precision_follows_the_precision_tables_megatron_flags():
    """Megatron's --bf16/--fp16 map to the table's entries; a new entry with a flag is picked up
    with no other edit; two flags at once are refused by name."""
    import torch

    from megatron_cona.arguments import precision_from_args
    from predictors.spec.precision import Precision, register_precision, unregister_precision

    ns = argparse.Namespace
    assert precision_from_args(ns(bf16=True, fp16=False)) == "bf16-mixed"
    assert precision_from_args(ns(bf16=False, fp16=True)) == "fp16-mixed"
    assert precision_from_args(ns(bf16=False, fp16=False)) == "fp32"
    with pytest.raises(ConaArgumentError, match="--bf16 and --fp16 cannot be combined"):
        precision_from_args(ns(bf16=True, fp16=True))
    register_precision(Precision("toy-half", torch.float16, torch.float16, False, True, True,
                                 megatron_flag="--toy-half"))  # fmt: skip
    try:
        assert precision_from_args(ns(bf16=False, fp16=False, toy_half=True)) == "toy-half"
    finally:
        unregister_precision("toy-half")


PLAN = ["plan", "--world", "4", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32"]


@pytest.mark.parametrize(
    "flag, value",
    [("--world", "0"), ("--num-layers", "0"), ("--hidden-size", "-64"),
     ("--num-attention-heads", "0"), ("--seq-length", "0"), ("--vocab-size", "0"),
     ("--base-batch", "0"), ("--top", "-1"), ("--noise-scale", "-5"), ("--noise-scale", "nan"),
     ("--noise-scale", "inf"),
     ("--world", str(10**30)), ("--num-layers", str(10**30)), ("--hidden-size", str(10**30)),
     ("--seq-length", str(10**30)), ("--vocab-size", str(10**30))],
)
def test_cli_plan_rejects_zero_negative_and_nan_numbers_naming_the_flag(flag, value, capsys):
    """Each ran before: a ZeroDivisionError (--num-attention-heads 0) or RuntimeError
    traceback (--vocab-size 0), a table of nonsense (--noise-scale -5, --top -1 dropped the
    last row, --world 0 blamed no candidates); 10^30 GPUs never returned, 10^30 layers, hidden
    units, tokens or vocabulary entries overflowed the time predictor (OverflowError/TypeError
    traceback). --global-batch-range and --micro-batches: the shared parsers' tests above."""
    from megatron_cona.cli import main

    argv = [*PLAN, flag, value] if flag not in PLAN else \
        [*PLAN[:PLAN.index(flag) + 1], value, *PLAN[PLAN.index(flag) + 2:]]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].startswith(f"cona plan: error: argument {flag}: ")
    assert "Traceback" not in "\n".join(err)


DECISION_LINE = ('{"iteration": 10, "switch": false, "current": {"strategy": "dp1", '
                 '"goodput": 1.0}, "best": {"strategy": "dp1", "goodput": 1.0}}\n')


@pytest.mark.parametrize(
    "content, says",
    [("garbage\n", "line 1: not JSON"),
     ('{"iteration": 10}\n', "line 1: no switch"),
     ('{"iteration": 10, "switch": false, "current": 3, "best": {}}\n',
      "line 1: no current.strategy/goodput"),
     ("\n[1, 2]\n", "line 2: no iteration"),
     ("\n", "holds no decisions"),
     (DECISION_LINE.replace('"iteration": 10', '"iteration": "10"'),
      "line 1: iteration='10' is not an integer >= 0"),
     (DECISION_LINE.replace('"iteration": 10', '"iteration": NaN'),
      "line 1: iteration=nan is not an integer >= 0"),
     (DECISION_LINE.replace('"switch": false', '"switch": "no"'),
      "line 1: switch='no' is not true or false"),
     (DECISION_LINE.replace('"goodput": 1.0}}', '"goodput": "x"}}'),
      "line 1: best.goodput='x' is not a number"),
     (DECISION_LINE.replace('"strategy": "dp1", "goodput": 1.0}, "best"',
                            '"strategy": 5, "goodput": 1.0}, "best"'),
      "line 1: current.strategy=5 is not a strategy name"),
     (DECISION_LINE.replace("}}", '}, "noise_scale": null}'),
      "line 1: noise_scale=None is not a number")],
)
def test_cli_plot_of_a_file_that_is_no_decision_log_names_file_and_line(tmp_path, capsys,
                                                                        content, says):
    """A --log that is not a --cona-log said 'JSONDecodeError: Expecting value: line 1 column 1'
    or 'KeyError: 'iteration'' without the file, or raised TypeError (traceback: also for a
    field of the wrong type, e.g. a string iteration or a null noise scale)."""
    from megatron_cona.cli import main

    log = tmp_path / "run.jsonl"
    log.write_text(content)
    assert main(["plot", "--log", str(log), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--cona-log {log} {says}" in err
    assert not (tmp_path / "t.png").exists()


def test_cona_cli_imports_no_torch_before_a_command_needs_it():
    """`cona plan`'s flags take their ceilings from megatron_cona.candidates (one copy of
    MAX_WORLD and MAX_GLOBAL_BATCH); importing the CLI, and so the candidates, must not pull in
    torch (~1.4 s before `--help` answers)."""
    import subprocess

    code = "import sys, megatron_cona.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_cli_plot_of_a_binary_file_names_it(tmp_path, capsys):
    """A binary --log raised UnicodeDecodeError (traceback)."""
    from megatron_cona.cli import main

    log = tmp_path / "run.jsonl"
    log.write_bytes(bytes(range(128, 256)) * 8)
    assert main(["plot", "--log", str(log), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"DecisionLogError: --cona-log {log}: not UTF-8 text" in err


@pytest.mark.parametrize("out, says", [("", "is a directory"), ("d", "is a directory"),
                                       ("t", "has no suffix"), ("t.", "has no suffix")])
def test_cli_plot_out_that_names_no_image_file_is_refused(tmp_path, monkeypatch, capsys, out,
                                                          says):
    """--out d (a directory) wrote d.png, --out '' wrote ./.png, --out t wrote t.png: each
    printed the path it was given, not the file it wrote."""
    from megatron_cona.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "run.jsonl").write_text(DECISION_LINE)
    assert main(["plot", "--log", "run.jsonl", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("cona plot: error: CliError: --out: ") and says in err
    assert not list(tmp_path.rglob("*.png"))


def test_cli_plot_to_a_format_matplotlib_lacks_names_out(tmp_path, capsys):
    """--out t.zzz said matplotlib's 'ValueError: Format 'zzz' is not supported' without the
    flag, after reading the log."""
    from megatron_cona.cli import main

    log = tmp_path / "run.jsonl"
    log.write_text(DECISION_LINE)
    assert main(["plot", "--log", str(log), "--out", str(tmp_path / "t.zzz")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"cona plot: error: CliError: --out: {tmp_path}/t.zzz: "
                                              "matplotlib writes no .zzz files (")
    assert not list(tmp_path.glob("t.*"))


@pytest.mark.parametrize("error", [KeyError("strategy"), ValueError("math domain error")])
def test_cli_keeps_the_traceback_of_an_error_that_is_no_bad_input(tmp_path, monkeypatch, error):
    """A KeyError or ValueError of our own code is a bug: it was printed as one 'error:' line
    (exit 2) like bad input, its traceback lost."""
    import megatron_cona.plot
    from megatron_cona.cli import main

    def broken(*args):
        raise error

    monkeypatch.setattr(megatron_cona.plot, "plot_run_timeline", broken)
    with pytest.raises(type(error)):
        main(["plot", "--log", str(tmp_path / "run.jsonl"), "--out", str(tmp_path / "t.png")])


def test_cli_input_errors_name_classes_that_exist():
    """The cli's table of input errors names each class by module: a renamed one would stop
    being caught (its bad input would print a traceback)."""
    import importlib

    from megatron_cona.cli import INPUT_ERRORS

    for module, name in INPUT_ERRORS:
        assert issubclass(getattr(importlib.import_module(module), name), Exception), name
