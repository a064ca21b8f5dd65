"""The law simulation's worlds in worker processes give the same report as in one process, and
every worker first runs the caller's ``init`` (here: registering the Pollux chain)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from megatron_cona.lawsim.chains import CHAINS  # noqa: E402
from megatron_cona.lawsim.evaluate import SimOptions, run_sim  # noqa: E402
from megatron_cona.lawsim.law import LawError  # noqa: E402

pytest.importorskip("adaptdl")
from cona_pollux import register_pollux  # noqa: E402


def test_two_worker_processes_give_the_one_process_report(tmp_path):
    before = dict(CHAINS)
    try:
        register_pollux()  # in this process; the workers get it only through ``init``
        reports = {}
        for jobs in (1, 2):
            opts = SimOptions(out=tmp_path / f"j{jobs}", families=("bert-large",),
                              gpus=(64, 8), variants=("kaplan",),
                              micro_batches=(1,), pipeline=(1,), batch_span=(1 / 8, 2.0),
                              exact_variants=(), jobs=jobs)
            reports[jobs] = run_sim(opts, (0.05, 0.001), say=lambda m: None,
                                    init=register_pollux)
    finally:
        CHAINS.clear()
        CHAINS.update(before)
    one, two = reports[1], reports[2]
    # the options' order (64 GPUs first), whichever world finished first
    assert [c["tag"] for c in two["cases"]] == ["bert-large/64gpu/kaplan",
                                                "bert-large/8gpu/kaplan"]
    assert all("pollux" in c["chains"] for c in two["cases"])
    assert two["cases"] == one["cases"] and two["summary"] == one["summary"]
    with pytest.raises(LawError, match="jobs=0"):
        SimOptions(jobs=0)
