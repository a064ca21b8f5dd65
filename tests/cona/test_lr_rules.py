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
