"""The one LR rule every TTP chain uses: sqrt scaling from one tuned base LR, or a per-batch
table from one sweep (widened while its best sits at an edge); the session applies the same
rule, and the replay refuses a chain whose LR differs from the case's rule."""

from __future__ import annotations

import math

import pytest

from megatron_cona.gns import GradStats
from megatron_cona.lr_scaling import BatchLR, LRScalingError, widen_sweep
from megatron_cona.session import SessionConfig
from megatron_cona.ttp.chains import ReplayExecutor, TTPError
from megatron_cona.ttp.clock import GPT_1_3B, SimulatedClock, VTrainTimes
from megatron_cona.ttp.stitch import CurveSet
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse


def test_sqrt_rule_from_one_base_lr():
    rule = BatchLR(2e-3, 64)
    assert rule.lr(64) == 2e-3
    assert rule.lr(16) == pytest.approx(1e-3)
    assert rule.lr(256) == pytest.approx(4e-3)
    assert rule.name == "sqrt@64"


def test_table_rule_and_interpolation_between_tabled_batches():
    rule = BatchLR.from_table({16: 1e-3, 64: 4e-3}, 64)
    assert rule.lr(16) == 1e-3 and rule.lr(64) == 4e-3
    assert rule.lr(32) == pytest.approx(2e-3)  # geometric in the batch (a ramp's batch)
    assert rule.lr(8) == 1e-3 and rule.lr(128) == 4e-3  # beyond the table: its edge
    assert rule.scale(16) == pytest.approx(0.25)
    with pytest.raises(LRScalingError, match="base_batch=8 is not in the LR table"):
        BatchLR.from_table({16: 1e-3}, 8)
    with pytest.raises(LRScalingError, match="rule='cubic'"):
        BatchLR(1e-3, 8, "cubic")


def test_sweep_widens_while_best_is_at_an_edge():
    best_lr = 8e-3
    tried = []

    def score(lr):
        tried.append(lr)
        return abs(math.log(lr / best_lr))
    best, scores = widen_sweep(score, [1e-3, 2e-3, 4e-3])
    assert best == pytest.approx(8e-3)
    assert sorted(scores) == pytest.approx([1e-3, 2e-3, 4e-3, 8e-3, 16e-3])
    # interior best: nothing added
    best, scores = widen_sweep(lambda lr: abs(lr - 2e-3), [1e-3, 2e-3, 4e-3])
    assert best == 2e-3 and len(scores) == 3
    # the low edge widens downwards
    best, _ = widen_sweep(lambda lr: lr, [1e-3, 2e-3], max_widen=2)
    assert best == pytest.approx(2.5e-4)


def test_session_applies_the_table_rule():
    cfg = SessionConfig(base_batch=64, lr_table={16: 1e-3, 64: 4e-3})
    assert cfg.batch_lr().scale(16) == pytest.approx(0.25)
    assert SessionConfig(base_batch=64).batch_lr().scale(16) == pytest.approx(0.5)


def test_replay_refuses_an_lr_other_than_the_case_rule():
    curves = CurveSet.from_points({8: ([0, 64, 128], [5.0, 4.0, 3.0]),
                                   16: ([0, 64, 128], [5.0, 4.5, 3.5])}, 64)
    clock = SimulatedClock(VTrainTimes(GPT_1_3B, 8), 0.1, 0.01, 300e9)
    rule = BatchLR.from_table({8: 1e-3, 16: 3e-3}, 16)
    ex = ReplayExecutor(clock, curves, rule, P("dp8tp1pp1mb1gb16"))
    ex.set_lr_scale(1.0)
    assert ex.switch(P("dp8tp1pp1mb1gb8")).switched
    ex.set_lr_scale(1 / 3)
    with pytest.raises(TTPError, match="one LR rule"):
        ex.set_lr_scale(math.sqrt(8 / 16))  # the sqrt rule is not this case's rule
    assert GradStats([1.0], 8, 1.0, 8).sample() is None  # one replica, no micro split
