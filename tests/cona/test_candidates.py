import logging

import pytest

from megatron_cona.candidates import (
    CandidateSpec,
    admissible_layouts,
    enumerate_candidates,
    global_batches,
    parse_candidate_list,
)
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec
from predictors.spec.precision import get_precision

GPT = TransformerSpec("gpt", num_layers=6, hidden_size=96, num_attention_heads=6,
                      seq_length=64, vocab_size=257)


def test_layouts_respect_world_heads_and_layers():
    layouts = admissible_layouts(8, GPT)
    # tp must divide 6 heads (tp in 1,2); pp must divide 6 layers (pp in 1,2)
    assert layouts == [(2, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
    for dp, tp, pp in layouts:
        assert dp * tp * pp == 8


def test_batches_are_multiples_of_dp_times_micro_within_range():
    spec = CandidateSpec(micro_batches=(1, 2), global_batch_range=(8, 32), batch_grid="all")
    cands = enumerate_candidates(4, GPT, spec)
    assert cands.kept
    for s in cands.kept:
        assert s.global_batch_size % (s.dp * s.micro_batch) == 0
        assert 8 <= s.global_batch_size <= 32
    assert ParallelStrategy(4, 1, 1, 2, 24) in cands.kept
    pow2 = global_batches(4, 2, 8, 64, "pow2")
    assert pow2 == [8, 16, 32, 64]


def test_user_list_mixes_layouts_and_fixed_entries():
    spec = parse_candidate_list("dp4tp1pp1, dp2tp2pp1mb2gb16")
    assert spec.layouts == ((4, 1, 1),)
    assert spec.fixed == (ParallelStrategy(2, 2, 1, 2, 16),)
    with pytest.raises(StrategyError, match="entry 'dp4tp1' is not"):
        parse_candidate_list("dp4tp1")
    with pytest.raises(StrategyError, match="global_batch=15"):
        parse_candidate_list("dp2tp1pp1mb2gb15")


def test_inadmissible_layout_rejected_with_reason():
    spec = CandidateSpec(layouts=((1, 4, 1), (4, 1, 1)), global_batch_range=(4, 4),
                         micro_batches=(1,))
    cands = enumerate_candidates(4, GPT, spec)
    assert cands.kept == [ParallelStrategy(4, 1, 1, 1, 4)]
    assert "tp=4 does not divide num_attention_heads=6" in cands.rejected[0].reason


class LinearMemory:
    """Peak memory that grows with micro-batch and shrinks with model parallelism."""

    def peak_bytes(self, model, strategy, precision):
        return 1e9 * strategy.micro_batch / (strategy.tp * strategy.pp)


def test_memory_model_drops_and_logs(caplog):
    spec = CandidateSpec(micro_batches=(1, 4), global_batch_range=(16, 16))
    with caplog.at_level(logging.INFO, logger="megatron_cona.candidates"):
        cands = enumerate_candidates(4, GPT, spec, precision=get_precision("bf16"),
                                     memory_model=LinearMemory(), memory_limit_bytes=2.5e9)
    dropped = {r.strategy for r in cands.rejected}
    assert ParallelStrategy(4, 1, 1, 4, 16) in dropped  # 4 GB > 2.5 GB
    assert ParallelStrategy(2, 2, 1, 4, 16) not in dropped  # 2 GB fits
    assert all(s not in dropped for s in cands.kept)
    assert "predicted peak memory" in caplog.text and "dp4tp1pp1mb4gb16" in caplog.text


def test_nothing_left_is_an_error():
    spec = CandidateSpec(layouts=((1, 4, 1),))
    with pytest.raises(StrategyError, match="no candidate strategy remains"):
        enumerate_candidates(4, GPT, spec)


@pytest.mark.parametrize("fields, says", [
    ({"micro_batches": (1, 2, 1)}, "micro_batches=(1, 2, 1) lists a value twice"),
    ({"micro_batches": (0, 2)}, "micro_batches=(0, 2) must list integers >= 1"),
    ({"micro_batches": (-2,)}, "micro_batches=(-2,) must list integers >= 1"),
    ({"micro_batches": ()}, "micro_batches=() must list integers >= 1"),
    ({"layouts": ((4, 1, 1), (4, 1, 1))}, "layouts=((4, 1, 1), (4, 1, 1)) lists a value twice"),
    ({"fixed": (ParallelStrategy(4, 1, 1, 1, 8),) * 2}, "fixed=(ParallelStrategy("),
    ({"global_batch_range": (0, 8)}, "global_batch_range=(0, 8) must be (MIN, MAX) with 1 <="),
    ({"global_batch_range": (64, 8)}, "global_batch_range=(64, 8) must be (MIN, MAX) with 1"),
    ({"global_batch_range": (8,)}, "global_batch_range=(8,) must be (MIN, MAX)"),
])
def test_a_spec_built_in_python_is_refused_naming_the_field(fields, says):
    """The command lines check their flags first; a spec built directly took a repeat silently,
    a 0 micro-batch was a ZeroDivisionError, a negative one never returned, MIN 0 was taken as
    1 and MAX < MIN ended in "no candidate strategy remains"."""
    with pytest.raises(StrategyError) as err:
        CandidateSpec(**fields)
    assert str(err.value).startswith(says)
    if "fixed" in fields:
        assert str(err.value).endswith("lists a value twice")


@pytest.mark.parametrize("values, says", [
    ((0, 2), "must list integers >= 1"), ((), "must list integers >= 1"),
    ((2, 4, 2), "lists a value twice"),
])
def test_a_flag_and_the_dataclasses_refuse_a_list_by_one_rule(values, says):
    """CandidateSpec and SimOptions each had their own copy of the flags' rule (each >= 1, each
    once), the flags in other words: all three now call predictors.flag_values.check_distinct."""
    from megatron_cona.lawsim.evaluate import SimOptions
    from megatron_cona.lawsim.law import LawError
    from predictors.flag_values import FlagValueError, check_distinct, parse_counts

    text = ",".join(map(str, values))
    with pytest.raises(FlagValueError) as flag:
        parse_counts(text)
    with pytest.raises(StrategyError) as spec:
        CandidateSpec(micro_batches=values)
    with pytest.raises(LawError) as sim:
        SimOptions(micro_batches=values)
    assert str(flag.value) == f"{text!r} {says}"
    assert str(spec.value) == str(sim.value) == f"micro_batches={values} {says}"
    assert check_distinct([4, 1], "sizes") == (4, 1)


def test_memory_predictor_drops_what_a_small_card_cannot_hold():
    from megatron_cona.candidates import PredictorMemory

    big = TransformerSpec("gpt", 24, 2048, 16, 1024, 51200)
    spec = CandidateSpec(layouts=((8, 1, 1), (1, 8, 1)), micro_batches=(1, 8),
                         global_batch_range=(64, 64))
    cands = enumerate_candidates(8, big, spec, precision=get_precision("bf16-mixed"),
                                 memory_model=PredictorMemory(16), memory_limit_bytes=16 * 2**30)
    dropped = {r.strategy for r in cands.rejected}
    assert ParallelStrategy(8, 1, 1, 8, 64) in dropped  # 1.3B unsharded, micro-batch 8
    assert ParallelStrategy(1, 8, 1, 1, 64) in cands.kept  # 8-way tensor parallel, micro 1


def test_memory_filter_uses_the_jobs_device_and_options():
    """An A100-80GB (compute 8.0) is predicted as Ampere (its CUDA context and allocator
    overheads), not as Hopper by its size; the job's distributed optimizer shards the Adam
    states, so a rank holds less."""
    import argparse

    from megatron_cona.session import memory_model_for
    from predictors.memory.api import predict_peak_memory

    model = TransformerSpec("gpt", 24, 2048, 16, 1024, 51200)
    strategy = ParallelStrategy(8, 1, 1, 1, 64)
    precision = get_precision("bf16-mixed")

    def args(**flags):
        return argparse.Namespace(num_layers=24, hidden_size=2048, num_attention_heads=16,
                                  seq_length=1024, micro_batch_size=1, global_batch_size=64,
                                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  **flags)

    ampere = memory_model_for(80 * 2**30, 8, args(), 8)
    hopper = memory_model_for(80 * 2**30, 9, args(), 8)
    assert (ampere.architecture, hopper.architecture) == ("pre-hopper", "hopper")
    a, h = (m.peak_bytes(model, strategy, precision) for m in (ampere, hopper))
    by_arch = {arch: predict_peak_memory(model, strategy, ampere.options, precision, 80,
                                         architecture=arch).device_total
               for arch in ("pre-hopper", "hopper")}
    assert (a, h) == (by_arch["pre-hopper"], by_arch["hopper"]) and a != h
    zero = memory_model_for(80 * 2**30, 9, args(use_distributed_optimizer=True), 8)
    assert zero.options.distributed_optimizer
    assert zero.peak_bytes(model, strategy, precision) < h


@pytest.mark.timeout(20)
def test_divisors_of_a_huge_world_come_back_at_once():
    """``cona plan --world 1000000000`` hung: the divisors were searched up to n."""
    from megatron_cona.candidates import divisors

    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(1) == [1]
    assert divisors(10**12)[-3:] == [250_000_000_000, 500_000_000_000, 10**12]
    assert len(divisors(10**12)) == 169  # 2^12 5^12: 13 * 13
