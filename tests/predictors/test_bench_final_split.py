"""The frozen final split of ``bench_time_predictor`` is scored once: without ``--score-final``
a run prints the recorded figure (or ``unscored``) and never evaluates it; with it, an existing
record refuses a second scoring before anything is evaluated."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("bench_time_predictor")
    return module


@pytest.fixture
def no_evaluation(monkeypatch):
    import predictors.time.evaluate as ev

    def refuse(*a, **k):
        raise AssertionError("the final split was evaluated")

    monkeypatch.setattr(ev, "evaluate_fleet_final", refuse)


def test_a_run_without_the_flag_reports_the_record_or_unscored(bench, tmp_path, no_evaluation):
    record = tmp_path / "final.json"
    assert bench.fleet_final(None, False, record) == "unscored"
    record.write_text(json.dumps({"commit": "a" * 40, "date": "2026-12-04T00:00:00Z",
                                  "mape": 9.671}))
    assert bench.fleet_final(None, False, record) == "9.67%"


def test_a_second_scoring_is_refused(bench, tmp_path, no_evaluation):
    record = tmp_path / "final.json"
    record.write_text(json.dumps({"commit": "b" * 40, "date": "2026-12-04T00:00:00Z",
                                  "mape": 9.671}))
    with pytest.raises(bench.FinalSplitAlreadyScored, match="bbbbbbbbbbbb"):
        bench.fleet_final(None, True, record)
    assert json.loads(record.read_text())["commit"] == "b" * 40  # the record is kept
