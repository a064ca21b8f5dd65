"""The one LR rule: sqrt scaling from one tuned base LR, or a per-batch table; the session
applies it."""

from __future__ import annotations

import pytest

from megatron_cona.lr_scaling import BatchLR, LRScalingError
from megatron_cona.session import SessionConfig


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


def test_session_applies_the_table_rule():
    cfg = SessionConfig(base_batch=64, lr_table={16: 1e-3, 64: 4e-3})
    assert cfg.batch_lr().scale(16) == pytest.approx(0.25)
    assert SessionConfig(base_batch=64).batch_lr().scale(16) == pytest.approx(0.5)


def test_the_schedule_factor_is_megatron_cores_decay_whatever_the_batch_rule_scaled():
    """megatron-core's own scheduler (linear warmup over 10 steps, cosine decay to a tenth
    over 100): the factor the progress check divides rates by is its LR over the peak, and a
    batch rule's scale (peak and floor together) leaves it as it was while the LR the
    optimizer steps with doubles."""
    torch = pytest.importorskip("torch")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_cona.executor import schedule_factor
    from megatron_cona.lr_scaling import BaseLR, apply_lr_scale

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                    lr_warmup_steps=10, lr_decay_steps=100,
                                    lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=100, wd_incr_style="constant")
    sched.step(increment=5)
    assert schedule_factor(sched) == pytest.approx(0.5)  # half-way up the warmup
    sched.step(increment=50)  # half-way down the cosine: 1e-4 + 0.5 x 9e-4
    assert schedule_factor(sched) == pytest.approx(0.55)
    base = BaseLR(sched)
    apply_lr_scale(sched, base, 2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(2 * 0.55e-3)
    assert schedule_factor(sched) == pytest.approx(0.55)
