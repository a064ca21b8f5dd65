"""One CONA loop: the same ConaSession driven through the runtime's executor, the Megatron-LM
hook's executor and the law simulation's executor (simulated clock) makes the same
decisions on a scripted case; the runtime really switches (batch and layout), the hook grows
the batch it can and says why it cannot switch a layout."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_cona.executor import SwitchUnsupported
from megatron_cona.gns import GradStats
from megatron_cona.hook import LAYOUT_UNSUPPORTED, MegatronLMExecutor
from megatron_cona.session import SessionConfig
from megatron_cpu.launch import run_distributed
from predictors.spec import ParallelStrategy

P = ParallelStrategy.parse
BATCH_ONLY = {"dp2tp1pp1mb2gb4": 0.08, "dp2tp1pp1mb2gb8": 0.15, "dp2tp1pp1mb2gb16": 0.16}
WITH_LAYOUT = {**BATCH_ONLY, "dp1tp2pp1mb2gb16": 0.12}
START = "dp2tp1pp1mb2gb8"


def _stats(strategy: ParallelStrategy, phi: float) -> GradStats:
    """Noise-free statistics of |G|^2 = 1 and tr(S) = phi at the strategy's batch sizes."""
    gb = strategy.global_batch_size
    local = gb // strategy.dp
    return GradStats([1 + phi / local] * strategy.dp, local, 1 + phi / gb, gb)


def _phi(iteration: int) -> float:
    # small noise early, large later (the probe's readings: the bias prior's centre, 10x, makes
    # them 2 and 3,000)
    return 0.2 if iteration <= 6 else 300.0


def _session(executor, table):
    from megatron_cona.gns import GradientNoiseScale
    from megatron_cona.goodput import CalibratedThroughput
    from megatron_cona.lawsim.clock import TableThroughput
    from megatron_cona.policy import PolicyConfig, SwitchPolicy
    from megatron_cona.session import ConaSession, SessionConfig

    cands = [P(n) for n in table]
    return ConaSession(cands, CalibratedThroughput(TableThroughput({P(n): t for n, t in
                                                                    table.items()})),
                       SwitchPolicy(PolicyConfig(min_gain=0.05, horizon_intervals=1e6,
                                                 patience=1, cooldown=0)),
                       GradientNoiseScale(0.5), SessionConfig(interval=2, base_batch=8),
                       executor)


def _drive(session, table, iterations=14, on_step=None):
    for it in range(1, iterations + 1):
        if on_step is not None:
            on_step()
        s = session.executor.strategy
        session.after_step(it, table[s.name], _stats(s, _phi(it)))
    return [(d.iteration, d.switch, d.current.strategy.name, d.best.strategy.name,
             round(d.gain, 9), round(d.noise_scale, 6)) for d in session.decisions]


class _Times:
    """The scripted table as the simulated clock's measured times."""

    def __init__(self, model, table) -> None:
        self.model, self.gpus = model, 2
        self.table = {P(name): t for name, t in table.items()}

    def lookup(self, s):
        return self.table.get(s)

    def line(self, s):
        return None


def _world(rank, world):
    from megatron_cona.data import VOCAB_SIZE, CorpusConfig, build_corpus
    from megatron_cona.lawsim.chains import SimExecutor
    from megatron_cona.lawsim.clock import GPT_1_3B, SimulatedClock
    from megatron_cona.runtime import TrainConfig, build_state, train_step
    from megatron_cona.runtime.executor import RuntimeExecutor
    from predictors.spec import TransformerSpec

    spec = TransformerSpec("gpt", 2, 32, 4, 16, VOCAB_SIZE)
    corpus = build_corpus(CorpusConfig(seq_length=16, max_train_bytes=1 << 18))
    out = {}

    # runtime: real steps, real switches
    runtime = RuntimeExecutor(build_state(TrainConfig(spec, lr=1e-3), P(START)))
    sess = _session(runtime, BATCH_ONLY)
    out["runtime"] = _drive(sess, BATCH_ONLY,
                            on_step=lambda: train_step(runtime.state, corpus.train))
    out["runtime_strategy"] = runtime.state.strategy.name
    # what the optimizer really steps with (megatron-core reads each param group's own max_lr
    # before the scheduler's: scaling the scheduler alone changed nothing)
    out["runtime_lr"] = ([g["lr"] for g in runtime.state.optimizer.param_groups],
                         1e-3 * sess.lr_scale(runtime.state.strategy))
    out["runtime_switches"] = [(r.old.name, r.new.name, r.outcome.switched)
                               for r in sess.switches]

    # Megatron-LM hook: the scheduler of a live state, global batch changed in place
    hook = MegatronLMExecutor(P(START), runtime.state.scheduler)
    out["hook"] = _drive(_session(hook, BATCH_ONLY), BATCH_ONLY)
    out["hook_strategy"] = hook.strategy.name

    # the law simulation's cluster: clock-charged switches
    clock = SimulatedClock(_Times(GPT_1_3B, BATCH_ONLY), 0.5, 0.01, 300e9)
    sim = SimExecutor(clock, P(START))
    out["simulated"] = _drive(_session(sim, BATCH_ONLY), BATCH_ONLY)
    out["simulated_exec"] = sim.strategy.global_batch_size
    out["simulated_charged"] = [c for *_, c in sim.pending]
    out["simulated_lr_scales"] = sim.lr_scales

    # a layout candidate wins: the runtime reshards, the hook says why it cannot
    sess = _session(runtime, WITH_LAYOUT)
    _drive(sess, WITH_LAYOUT, on_step=lambda: train_step(runtime.state, corpus.train))
    out["layout_switches"] = [(r.new.name, r.outcome.switched, r.outcome.moved_tensors)
                              for r in sess.switches]
    out["layout_loss_finite"] = math.isfinite(train_step(runtime.state, corpus.train).loss)
    # the layout switch rebuilt optimizer and scheduler from the config: the scale still holds
    out["layout_lr"] = ([g["lr"] for g in runtime.state.optimizer.param_groups],
                        1e-3 * sess.lr_scale(runtime.state.strategy))
    hook = MegatronLMExecutor(P(START), runtime.state.scheduler)
    sess = _session(hook, WITH_LAYOUT)
    _drive(sess, WITH_LAYOUT)
    out["hook_unsupported"] = [(u.target.name, u.reason) for u in sess.unsupported]
    out["hook_layout_strategy"] = hook.strategy.name
    runtime.state.destroy()
    return out


@pytest.mark.slow
@pytest.mark.megatron
def test_three_executors_drive_the_same_session():
    results = run_distributed(_world, 2, timeout=600)
    res = results[0]
    assert results[1]["runtime"] == res["runtime"]
    decisions = res["runtime"]
    assert len(decisions) == 7 and any(d[1] for d in decisions)
    assert res["hook"] == decisions
    assert res["simulated"] == decisions
    # small noise first: the session goes to the small batch, then to the large one
    chosen = [d[3] for d in decisions if d[1]]
    assert chosen[0].endswith("gb4") and chosen[-1].endswith("gb16")
    assert res["runtime_strategy"] == res["hook_strategy"] == chosen[-1]
    assert res["simulated_exec"] == 16  # the trainer really runs the chosen batch
    assert res["simulated_charged"] == [0.01] * len(chosen)
    # the session's one LR rule (sqrt from the base batch 8) at every batch it moved to
    batches = [P(name).global_batch_size for name in chosen]
    assert res["simulated_lr_scales"][-len(batches):] == pytest.approx(
        [math.sqrt(b / 8) for b in batches])
    assert all(ok for *_, ok in res["runtime_switches"])
    lrs, expected = res["runtime_lr"]
    assert expected == pytest.approx(1e-3 * math.sqrt(16 / 8))
    assert len(lrs) == 2 and lrs == pytest.approx([expected] * len(lrs))  # decay and no-decay
    lrs, expected = res["layout_lr"]
    assert lrs == pytest.approx([expected] * len(lrs))
    # layout: the runtime moved tensors; the hook recorded why it could not
    assert ("dp1tp2pp1mb2gb16", True, True) in res["layout_switches"]
    assert res["layout_loss_finite"]
    assert res["hook_unsupported"] and res["hook_unsupported"][0][0] == "dp1tp2pp1mb2gb16"
    assert LAYOUT_UNSUPPORTED in res["hook_unsupported"][0][1]
    # ... named once, not at every ranking, while the hook grows the batch it can: the large
    # batch on the running layout (it stayed on the small one, every ranking choosing the
    # layout it cannot switch to)
    assert len(res["hook_unsupported"]) == 1
    assert res["hook_layout_strategy"] == "dp2tp1pp1mb2gb16"


def test_hook_executor_names_why_a_layout_cannot_switch():
    sched = SimpleNamespace(max_lr=1e-3, min_lr=1e-4, optimizer=SimpleNamespace(param_groups=[]))
    hook = MegatronLMExecutor(P("dp4tp1pp1mb2gb16"), sched)
    with pytest.raises(SwitchUnsupported, match="train\\(\\) holds the model, optimizer"):
        hook.switch(P("dp2tp2pp1mb2gb16"))
    with pytest.raises(SwitchUnsupported, match="dp4tp1pp1mb2gb16 -> dp4tp1pp1mb4gb16"):
        hook.switch(P("dp4tp1pp1mb4gb16"))  # micro-batch: the data loader is built for one
    assert hook.strategy == P("dp4tp1pp1mb2gb16")


class _BatchExecutor:
    """A single-process executor that records its switches and LR scales."""

    def __init__(self, start: ParallelStrategy) -> None:
        self.strategy, self.lr_scales = start, []

    def agree(self, strategy):
        return strategy

    def why_not(self, target):
        return None

    def switch(self, target):
        from megatron_cona.executor import SwitchOutcome

        self.strategy = target
        return SwitchOutcome(True, 0.0)

    def set_lr_scale(self, scale):
        self.lr_scales.append(scale)

    def lr_factor(self):
        return 1.0


def _start_session(start: str, current: str, names: list[str]):
    from megatron_cona.gns import GradientNoiseScale
    from megatron_cona.goodput import CalibratedThroughput
    from megatron_cona.lawsim.clock import TableThroughput
    from megatron_cona.policy import PolicyConfig, SwitchPolicy
    from megatron_cona.session import ConaSession, SessionConfig

    ex = _BatchExecutor(P(current))
    cands = [P(n) for n in names]
    session = ConaSession(cands, CalibratedThroughput(TableThroughput(dict.fromkeys(cands, 1.0))),
                          SwitchPolicy(PolicyConfig()), GradientNoiseScale(0.5),
                          SessionConfig(base_batch=P(current).global_batch_size, start=start),
                          ex)
    return session, ex


def test_begin_starts_at_the_smallest_batch_on_the_configured_layout():
    names = ["dp2tp1pp1mb2gb4", "dp2tp1pp1mb2gb8", "dp2tp1pp1mb2gb16", "dp1tp2pp1mb2gb2",
             "dp2tp1pp1mb1gb2"]
    session, ex = _start_session("smallest", "dp2tp1pp1mb2gb16", names)
    outcome = session.begin()
    # gb2 exists only on other layouts / micro-batches: a batch-only switch to gb4
    assert outcome.switched and ex.strategy == P("dp2tp1pp1mb2gb4")
    assert ex.lr_scales == pytest.approx([math.sqrt(4 / 16)])  # the one LR rule
    assert [(r.old.name, r.new.name) for r in session.switches] == [
        ("dp2tp1pp1mb2gb16", "dp2tp1pp1mb2gb4")]
    assert session._judging is None  # nothing to compare a start against
    # already there, or asked to keep the configured batch: nothing happens
    assert session.begin() is None
    session, ex = _start_session("configured", "dp2tp1pp1mb2gb16", names)
    assert session.begin() is None and ex.strategy == P("dp2tp1pp1mb2gb16")


def test_begin_never_starts_on_a_layout_blind_to_the_noise_scale():
    # DP = 1: gb2 would be one micro-batch, where the probe reads no small-batch gradient
    names = ["dp1tp2pp1mb2gb2", "dp1tp2pp1mb2gb4", "dp1tp2pp1mb2gb8"]
    session, ex = _start_session("smallest", "dp1tp2pp1mb2gb8", names)
    session.begin()
    assert ex.strategy == P("dp1tp2pp1mb2gb4")
    with pytest.raises(ValueError, match="start='tiny'"):
        _start_session("tiny", "dp1tp2pp1mb2gb8", names)


@pytest.mark.parametrize("bracket", [-1, 5, 1.5])
def test_session_config_refuses_a_bracket_outside_zero_to_judge_intervals(bracket):
    with pytest.raises(ValueError, match=r"bracket=.*judge_intervals \(4\)"):
        SessionConfig(bracket=bracket)
