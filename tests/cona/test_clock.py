"""The law simulation's clock: measured vTrain times, reshard-plan switch costs."""

from __future__ import annotations

import pytest

from megatron_cona.lawsim.clock import GPT_1_3B, ClockError, SimulatedClock, VTrainTimes
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse


def _clock() -> SimulatedClock:
    return SimulatedClock(VTrainTimes(GPT_1_3B, 8), fixed_switch_s=0.25, batch_switch_s=0.002,
                          link_bytes_per_s=300e9)


def test_clock_charges_measured_times_and_measured_layout_lines():
    clock = _clock()
    assert len(clock.measured.table) == 90  # h2048, 24 layers, seq 1024 on 8 GPUs
    # row of ground_truth_single.csv: 8 GPUs, gb 16, mb 1, tp1 dp8 pp1 -> 215.029881 ms
    assert clock.iteration_time(P("dp8tp1pp1mb1gb16")) == pytest.approx(0.215029881)
    # gb 48 was not measured on dp8 mb1: the line through gb 16/32/64/128 of that layout
    t48 = clock.iteration_time(P("dp8tp1pp1mb1gb48"))
    assert clock.iteration_time(P("dp8tp1pp1mb1gb32")) < t48 < clock.iteration_time(
        P("dp8tp1pp1mb1gb64"))
    assert (clock.exact, clock.interpolated) == (3, 1)
    with pytest.raises(ClockError, match="dp8tp1pp1mb2gb16"):  # below gb 32..128: no line
        clock.iteration_time(P("dp8tp1pp1mb2gb16"))
    with pytest.raises(ClockError, match="dp1tp2pp4mb8gb64.*micro-batch 8"):
        clock.iteration_time(P("dp1tp2pp4mb8gb64"))  # vTrain measured that layout once


def test_switch_cost_is_plan_bytes_over_nvlink_plus_fixed_cost():
    clock = _clock()
    a, b = P("dp8tp1pp1mb1gb16"), P("dp1tp8pp1mb1gb16")
    assert clock.switch_time(a, a) == 0.0
    assert clock.switch_time(a, P("dp8tp1pp1mb2gb32")) == 0.002  # batch only
    # every rank of dp8 holds the whole state: tp8 shards are read locally, nothing moves
    assert clock.moved_bytes(a.layout, b.layout) == 0
    assert clock.switch_time(a, b) == 0.25
    # tp8 -> dp8: each rank receives the 7/8 of the (untied-vocab-padded) state it lacks
    moved = clock.moved_bytes(b.layout, a.layout)
    params = GPT_1_3B.num_parameters()
    assert 0.8 * params * 14 * 7 / 8 < moved < 1.1 * params * 14 * 7 / 8
    assert clock.switch_time(b, a) == pytest.approx(0.25 + moved / 300e9)
