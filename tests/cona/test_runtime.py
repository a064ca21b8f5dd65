"""The CONA runtime on real megatron-core (GPTModel, DDP, optimizer, schedules) over 2 gloo ranks:
training makes progress, gradient statistics are what they claim, evaluation has no side effects,
groups don't leak, and bad input is rejected with a named error."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_cona.runtime import TokenDataset, TrainConfig  # noqa: E402
from megatron_cpu.launch import run_distributed  # noqa: E402
from predictors.spec import TransformerSpec  # noqa: E402
from predictors.spec.precision import UnknownPrecisionError  # noqa: E402

SPEC = TransformerSpec("gpt", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=64)


def test_config_rejects_unknown_and_unsupported_precision():
    with pytest.raises(UnknownPrecisionError, match="precision='fp7'"):
        TrainConfig(SPEC, precision="fp7")
    with pytest.raises(ValueError, match="precision='fp8' is not supported"):
        TrainConfig(SPEC, precision="fp8")


def test_padded_vocab_is_layout_independent():
    cfg = TrainConfig(SPEC, make_vocab_size_divisible_by=8)
    assert cfg.padded_vocab_size(4) == 64
    assert TrainConfig(SPEC, make_vocab_size_divisible_by=128).padded_vocab_size(4) == 512


def test_dataset_wraps_and_shifts():
    ds = TokenDataset(torch.arange(100), seq_length=8)
    batch = ds.samples(12, 2)
    assert batch.shape == (2, 9)
    assert batch[0].tolist() == [(96 + i) % 100 for i in range(9)]
    with pytest.raises(ValueError, match="seq_length"):
        TokenDataset(torch.arange(5), seq_length=8)


def _learnable(spec: TransformerSpec) -> TokenDataset:
    # A repeating pattern: a GPT must learn it quickly, so the loss has to fall.
    pattern = torch.randint(0, spec.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    return TokenDataset(pattern.repeat(200), spec.seq_length)


def _world(rank, world):
    import torch.distributed as dist

    from megatron_cona.parallel import live_group_count
    from megatron_cona.runtime import build_state, evaluate, train_step
    from predictors.spec import ParallelStrategy, StrategyError

    out = {}
    baseline = live_group_count()
    data = _learnable(SPEC)

    # 1. progress: dp2, two micro-batches per replica, Adam
    cfg = TrainConfig(SPEC, lr=1e-2, lr_warmup_samples=0)
    state = build_state(cfg, ParallelStrategy.parse("dp2tp1pp1mb1gb4"))
    captured = []
    state.pre_reduction_hooks.append(
        lambda st, chunks: captured.append(torch.cat([p.main_grad.detach().flatten().clone()
                                                      for p in st.core_model.parameters()])))
    results = [train_step(state, data, grad_stats=True) for _ in range(12)]
    out["losses"] = [r.loss for r in results]
    out["consumed"] = state.consumed_samples
    stats = results[-1].grad_stats
    mine = captured[-1].double()
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    mean = sum(everyone) / world
    out["local_direct"] = float(mine.pow(2).sum())
    out["local_reported"] = stats.local_sq_norms[rank]
    out["replicas_differ"] = not torch.equal(everyone[0], everyone[1])
    # the optimizer reports the pre-clip norm of the DP-averaged gradient
    out["global_direct"] = float(mean.pow(2).sum())
    out["global_reported"] = stats.global_sq_norm
    out["hook_calls"] = len(captured)
    out["first_mb"] = stats.first_microbatch_sq_norm
    out["batches"] = (stats.local_batch, stats.global_batch, stats.micro_batch)
    before = (state.iteration, state.consumed_samples)
    e1, e2 = evaluate(state, data, 1000, 8), evaluate(state, data, 1000, 8)
    out["eval"] = (e1, e2, before == (state.iteration, state.consumed_samples))
    with pytest.raises(ValueError, match="num_samples=3"):
        evaluate(state, data, 0, 3)
    state.destroy()

    # 2. model-parallel norms: with one replica the pre-reduction norm IS the global one, so
    # the runtime's dedup of TP duplicates and of the pipeline's tied embedding copy must agree
    # with megatron's own grad-norm computation.
    for name in ("dp1tp2pp1mb1gb2", "dp1tp1pp2mb1gb2"):
        st = build_state(TrainConfig(SPEC, precision="bf16-mixed"), ParallelStrategy.parse(name))
        r = train_step(st, data, grad_stats=True)
        out[name] = (r.grad_stats.local_sq_norms[0], r.grad_stats.global_sq_norm,
                     r.grad_stats.first_microbatch_sq_norm, math.isfinite(r.loss))
        st.destroy()

    # 3. the first micro-batch's gradient read on every layout: PP = 2 (each stage reads after
    # its first backward, the stages summed, the tied embedding's two copies combined) gives
    # the same number as PP = 1 from the same weights (moved by the in-memory switch) and data
    from megatron_cona.runtime import switch_strategy

    one = ParallelStrategy.parse("dp1tp2pp1mb1gb4")
    a = build_state(TrainConfig(SPEC), one)
    first = train_step(a, data, grad_stats=True).grad_stats
    a.destroy()
    b = build_state(TrainConfig(SPEC), one)
    moved = switch_strategy(b, ParallelStrategy.parse("dp1tp1pp2mb1gb4"))
    assert moved.switched, moved.error
    second = train_step(moved.state, data, grad_stats=True).grad_stats
    moved.state.destroy()
    out["first_mb_layouts"] = [(g.first_microbatch_sq_norm, g.global_sq_norm)
                               for g in (first, second)]
    out["first_mb_sample"] = second.sample().small_batch, second.sample().big_batch

    # 4. bad input, named
    errors = {}
    for text, spec in (("dp4tp1pp1", SPEC),
                       ("dp1tp2pp1", TransformerSpec("gpt", 2, 30, 3, 16, 64)),
                       ("dp1tp1pp2", TransformerSpec("gpt", 3, 32, 4, 16, 64))):
        try:
            build_state(TrainConfig(spec), ParallelStrategy.parse(text))
        except StrategyError as exc:
            errors[text] = str(exc)
    out["errors"] = errors
    out["leaked"] = live_group_count() - baseline
    return out


@pytest.mark.slow
@pytest.mark.megatron
def test_runtime_on_two_ranks():
    results = run_distributed(_world, 2, timeout=600)
    for rank, res in enumerate(results):
        losses = res["losses"]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < 0.7 * losses[0], losses
        assert res["consumed"] == 12 * 4
        assert res["hook_calls"] == 12
        assert res["replicas_differ"]  # the hook sees unreduced, per-replica gradients
        assert res["local_reported"] == pytest.approx(res["local_direct"], rel=1e-6)
        assert res["global_reported"] == pytest.approx(res["global_direct"], rel=1e-5)
        assert res["first_mb"] is not None and res["first_mb"] > 0
        assert res["batches"] == (2, 4, 1)
        e1, e2, unchanged = res["eval"]
        assert e1 == e2 and unchanged and math.isfinite(e1)
        assert e1 == results[0]["eval"][0]  # identical on every rank
        local, glob, first_mb, finite = res["dp1tp2pp1mb1gb2"]
        assert finite and local == pytest.approx(glob, rel=1e-5) and first_mb > 0
        local, glob, first_mb, finite = res["dp1tp1pp2mb1gb2"]
        # two micro-batches on two stages: the first one's gradient read as with PP = 1
        assert finite and local == pytest.approx(glob, rel=1e-5) and first_mb > 0
        (pp1_first, pp1_global), (pp2_first, pp2_global) = res["first_mb_layouts"]
        assert pp2_global == pytest.approx(pp1_global, rel=1e-5)
        assert pp2_first == pytest.approx(pp1_first, rel=1e-5)
        assert pp2_first > 1.5 * pp2_global  # one micro-batch's gradient is the noisier one
        assert res["first_mb_sample"] == (1, 4)
        assert "world_size=2" in res["errors"]["dp4tp1pp1"]
        assert "num_attention_heads=3" in res["errors"]["dp1tp2pp1"]
        assert "num_layers=3" in res["errors"]["dp1tp1pp2"]
        assert res["leaked"] == 0, f"rank {rank} leaked process groups"
