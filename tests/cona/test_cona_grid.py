"""benchmarks/cona_grid.py: the development grid's ratios (static / CONA per case-target and
seed), each row's worst over families, targets and seeds, and the comparison of two grids on
the case-targets they share."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cona_grid  # noqa: E402


def _case(variant: str, gpus: int, family: str, times: dict[str, tuple[float, float]]) -> dict:
    """A sim.json case whose targets have (static, cona) seconds ``times`` (the oracle and
    the bound, which the benchmark's ratios also read, at 50 s)."""
    return {"variant": variant, "gpus": gpus, "family": family,
            "targets": {t: {} for t in times},
            "chains": {"static": {t: {"time_s": s} for t, (s, _) in times.items()},
                       "cona": {t: {"time_s": c} for t, (_, c) in times.items()},
                       "oracle": {t: {"time_s": 50.0, "switches": 0} for t in times},
                       "bound": {t: {"time_s": 50.0, "relaxed_s": 50.0} for t in times}}}


def _write(root: Path, seed: int, cases: list[dict]) -> None:
    (root / f"seed{seed}").mkdir(parents=True)
    (root / f"seed{seed}" / "sim.json").write_text(json.dumps({"cases": cases}))


def test_rows_take_the_worst_over_families_targets_and_seeds(tmp_path):
    _write(tmp_path, 0, [_case("kaplan", 8, "a", {"t1": (100, 100), "t2": (90, 100)}),
                         _case("kaplan", 8, "b", {"t1": (100, 80), "t2": (100, 100)}),
                         _case("plateau", 64, "a", {"t1": (100, 96), "t2": (100, 104)})])
    _write(tmp_path, 1, [_case("kaplan", 8, "a", {"t1": (100, 125), "t2": (100, 100)}),
                         _case("plateau", 64, "a", {"t1": (100, 100), "t2": (100, 100)})])
    r = cona_grid.load(tmp_path)
    assert len(r) == 10 and r[("kaplan", 8, "b", "t1", 0)] == 100 / 80
    assert cona_grid.rows(r) == {("kaplan", 8): 100 / 125, ("plateau", 64): 100 / 104}
    text = cona_grid.summary(r)
    values = list(r.values())
    assert f"geomean={math.exp(sum(map(math.log, values)) / 10):.4f}" in text
    assert "min=0.800" in text and ">=0.95:8" in text and ">=1.0:7" in text
    assert "rows_ok=1/2" in text  # plateau's worst 0.962; kaplan's 0.8 (seed 1)


def test_compare_uses_the_shared_case_targets_and_stars_a_row_crossing_the_goal():
    before = {("kaplan", 8, "a", "t1", 0): 0.90, ("kaplan", 8, "a", "t1", 1): 0.99,
              ("plateau", 8, "a", "t1", 0): 0.97}
    after = {("kaplan", 8, "a", "t1", 0): 0.96, ("plateau", 8, "a", "t1", 0): 0.97,
             ("plateau", 8, "a", "t1", 5): 0.50}  # seed 5 ran only after: not compared
    lines = cona_grid.compare(before, after)
    assert lines[0].startswith("before n=2 ") and lines[1].startswith("after  n=2 ")
    assert "min=0.900" in lines[0] and "min=0.960" in lines[1]
    assert lines[2].split() == ["kaplan", "8", "GPUs", "0.900", "->", "0.960", "*"]
    assert lines[3].split() == ["plateau", "8", "GPUs", "0.970", "->", "0.970"]


def test_seeds_are_taken_in_order():
    assert cona_grid.grid_parser().parse_args(["--seeds", "3, 0,1"]).seeds == (3, 0, 1)
    assert cona_grid.grid_parser().parse_args([]).seeds == (0, 1, 2)


@pytest.mark.parametrize("text, says", [
    ("0,1,0", "'0,1,0' lists a value twice"),
    ("1,-1", "'1,-1' must list integers >= 0"),
    ("0;1", "'0;1' is not a comma-separated list of integers"),
])
def test_a_repeated_or_negative_seed_is_refused_naming_the_flag(text, says, capsys):
    """Only the parser runs (no grid): a repeat ran its seed twice and counted it twice in every
    summary; a negative one was refused by SimOptions with a traceback after the seeds before
    it had run (~5 minutes each); '0;1' was argparse's bare "invalid <lambda> value"."""
    with pytest.raises(SystemExit) as exc:
        cona_grid.grid_parser().parse_args(["--seeds", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].endswith(f"error: argument --seeds: {says}")
