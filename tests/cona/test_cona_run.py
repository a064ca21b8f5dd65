"""4 gloo ranks, real megatron-core: training with --cona switches strategy (layout AND batch)
and keeps training with finite, decreasing loss; without --cona the static strategy trains."""

import json
import math

import pytest

from megatron_cpu.launch import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--lr", "2e-3", "--lr-decay-style", "constant",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1000",
        "--eval-interval", "0"]


def _train_both(rank, world, log_path):
    from megatron_cona.arguments import add_cona_args
    from megatron_cona.pretrain_gpt import parse_args, train

    cona = train(parse_args(
        [*TINY, "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "24",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--cona", "--cona-interval", "4", "--cona-candidates", "dp4tp1pp1,dp2tp2pp1",
         "--cona-global-batch-range", "8,32", "--cona-patience", "1", "--cona-cooldown", "0",
         "--cona-log", log_path], extra_args_provider=add_cona_args))
    static = train(parse_args(
        [*TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
         "--tensor-model-parallel-size", "2"], extra_args_provider=add_cona_args))
    return cona.__dict__, static.__dict__


@pytest.mark.slow
@pytest.mark.megatron
def test_four_rank_cona_run_switches_and_trains(tmp_path):
    log_path = str(tmp_path / "cona.jsonl")
    results = run_distributed(_train_both, 4, log_path, timeout=400)
    cona, static = results[0]
    assert all(r[0]["losses"] == cona["losses"] for r in results)  # every rank agrees
    assert all(r[0]["timeline"] == cona["timeline"] for r in results)
    losses = cona["losses"]
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5
    assert len(cona["switches"]) >= 1
    # the start dp1tp2pp2 is not a candidate: the first switch moves weights + optimizer state
    first = cona["switches"][0]
    assert first["from"].startswith("dp1tp2pp2") and first["moved_tensors"]
    assert cona["timeline"][0][1] == "dp1tp2pp2mb4gb32"
    decisions = [json.loads(x) for x in open(log_path)]
    assert len(decisions) == 5  # iterations 4, 8, 12, 16, 20
    assert sum(d["switch"] for d in decisions) == len(cona["switches"])
    # the first layout switch is priced at this job's own state build where it exceeds the
    # 1 s default (SwitchCostModel.for_build)
    assert cona["build_seconds"] > 0
    assert decisions[0]["switch_cost_s"] == pytest.approx(max(1.0, cona["build_seconds"]))
    for d in decisions:
        assert d["current"]["goodput"] > 0 and d["best"]["iteration_time_s"] > 0
        assert d["reason"]
    # without --cona: the static strategy, no ranking, no switch
    assert static["switches"] == [] and static["timeline"] == [(0, "dp2tp2pp1mb2gb8")]
    assert all(math.isfinite(x) for x in static["losses"])
