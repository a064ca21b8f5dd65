"""The law-based simulator (megatron_cona.lawsim): its constants against their cited values, the
law's step and McCandlish's identity, the exact DP against brute force, the relaxed bound below
it, the simulated probe unbiased for B_noise, and CONA's controller seeing nothing private."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megatron_cona.gns import GradStats, unbiased_estimates
from megatron_cona.lawsim.bound import exact_bound, relaxed_bound
from megatron_cona.lawsim.checks import critical_batch_identity, doubling_per_loss_drop
from megatron_cona.lawsim.constants import CONSTANTS, value
from megatron_cona.lawsim.law import (
    DataCriticalBatch,
    LawError,
    LossCriticalBatch,
    ModelLaw,
    kaplan_bcrit,
)
from megatron_cona.lawsim.probe import SimulatedProbe
from megatron_cona.lawsim.schedules import rampup_batch, seesaw_batch
from predictors.spec import ParallelStrategy

CITED = {  # name: (value, words the source must name)
    "alpha_N": (0.077, ("Kaplan", "Eq 1.6")), "alpha_S": (0.76, ("Kaplan", "Eq 1.6")),
    "N_c": (6.5e13, ("Kaplan", "Eq 1.6")), "S_c": (2.1e3, ("Kaplan", "Eq 1.6")),
    "B_star": (2e8, ("Kaplan", "Eq 5.3")), "alpha_B": (0.21, ("Kaplan", "Eq 5.3")),
    "crit_batch_data_exponent": (0.47, ("Zhang", "2024")),
    "tokens_per_param": (20.0, ("Hoffmann", "2022")),
    "gpt3_1p3b_batch_tokens": (2**20, ("Brown", "Table 2.1")),
    "bert_batch_seqs": (256, ("Devlin",)), "roberta_ppl": (3.68, ("Liu", "Table 3")),
}


def test_constants_table_holds_the_cited_values_with_sources():
    for name, (want, words) in CITED.items():
        const = CONSTANTS[name]
        assert const.value == pytest.approx(want), name
        assert all(w in const.source for w in words), (name, const.source)
    for name, const in CONSTANTS.items():
        assert const.source and const.kind in ("law", "recipe", "check", "model", "measured"), \
            name
    with pytest.raises(KeyError, match="'nope' is not in the lawsim constants table"):
        value("nope")


LAW = ModelLaw("kaplan", 1.2e9, value("B_star"))


@pytest.mark.parametrize("dyn", [LossCriticalBatch(LAW, value("B_star")),
                                 DataCriticalBatch(LAW, 2.6e10, 1.5e6)])
def test_one_step_advances_s_min_by_mccandlish(dyn):
    """dS_min = 1 / (1 + B_crit / B) per step (McCandlish Eq 2.11-2.12)."""
    s, d = LAW.s_min(4.0), 3e9
    for batch in (2048.0, 2**17, 2**21):
        step = dyn.advance(s, d, batch, batch) - s
        want = 1.0 / (1.0 + dyn.b_crit(s, d) / batch)
        assert step == pytest.approx(want, rel=2e-3)
        assert dyn.tokens_to(s, d, batch, s + step) == pytest.approx(batch, rel=1e-6)


def test_critical_batch_identity_and_doubling():
    assert critical_batch_identity().passed
    assert doubling_per_loss_drop().passed
    assert kaplan_bcrit(3.0, 2e8) == pytest.approx(2e8 / 3.0 ** (1 / 0.21))


def test_bad_law_input_names_the_field():
    with pytest.raises(LawError, match="b_star=-1"):
        ModelLaw("x", 1e9, -1)
    with pytest.raises(LawError, match="anchor_bcrit=0"):
        DataCriticalBatch(LAW, 1e9, 0.0)


def _brute_force(dyn, bounds, strategies, seq, step, switch, goal, s0):
    best = math.inf
    for seq_choice in itertools.product(strategies, repeat=len(bounds) - 1):
        s, t, prev = s0, 0.0, None
        for (d, d2), x in zip(zip(bounds, bounds[1:], strict=False), seq_choice, strict=False):
            t += switch(prev, x) if prev is not None else 0.0
            b = x.global_batch_size * seq
            s2 = dyn.advance(s, d, b, d2 - d)
            if s < goal <= s2:
                best = min(best, t + dyn.tokens_to(s, d, b, goal) / b * step(x))
                break
            s, t, prev = s2, t + (d2 - d) / b * step(x), x
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["loss", "data"])
def test_exact_dp_equals_brute_force_and_relaxation_is_below(seed, kind):
    rng = np.random.default_rng(seed)
    law = ModelLaw("t", 1e8, 2e8)
    dyn = LossCriticalBatch(law, 2e8) if kind == "loss" else DataCriticalBatch(law, 1e8, 2e5)
    seq = 1024
    strategies = [ParallelStrategy(dp, 8 // dp, 1, 1, b) for dp in (2, 4, 8)
                  for b in (8, 32, 128) if b % dp == 0]
    times = {s: float(rng.uniform(0.2, 1.0)) * s.global_batch_size ** 0.5 * (1 + s.tp / 8)
             for s in strategies}
    cost = {(a.layout, b.layout): float(rng.uniform(0, 3)) for a in strategies
            for b in strategies}

    def switch(a, b):
        if a == b:
            return 0.0
        return 0.05 if a.layout == b.layout else cost[(a.layout, b.layout)]

    bounds = list(np.cumsum([0.0, *rng.uniform(2e5, 2e6, 4)]))
    s0 = law.s0
    reach = dyn.advance(s0, 0.0, 32 * seq, bounds[-1])
    goal = s0 + 0.8 * (reach - s0)
    brute = _brute_force(dyn, bounds, strategies, seq, times.__getitem__, switch, goal, s0)
    dp = exact_bound(dyn, bounds, strategies, seq, times.__getitem__, switch, [goal], s0)[0]
    assert dp.time == pytest.approx(brute, rel=1e-9)
    # pruning by the relaxation's cost-to-go only drops states that cannot win
    full = exact_bound(dyn, bounds, strategies, seq, times.__getitem__, switch, [goal], s0,
                       prune=False)[0]
    assert full.time == dp.time and full.path == dp.path
    relaxed = relaxed_bound(dyn, strategies, seq, times.__getitem__, [goal], s0)[0]
    assert relaxed <= dp.time * (1 + 1e-6)


# seeds whose fastest paths switch layouts (changing the batch with them) and whose goals are
# settled in different rounds, some below a cap from the relaxation, some at the greedy path's
@pytest.mark.parametrize("seed", [11, 26, 34])
@pytest.mark.parametrize("batch_switch", [3600.0, 1e30])
def test_exact_dp_equals_brute_force_when_a_batch_switch_costs_far_more(seed, batch_switch):
    """`cona scale --switch-costs 0,3600` (an hour per batch switch, milliseconds per layout
    switch, which may change the batch too) took minutes and 0,1e30 never returned: the DP's
    caps start near the relaxation now and widen in rounds, and entries are pruned per next
    strategy. Still exact: two goals against brute force and the unpruned DP, B_crit crossing
    the batches (B* 2e9 tokens: 24k to 67k over the run) so that switching pays."""
    rng = np.random.default_rng(seed)
    law = ModelLaw("t", 1e8, 2e8)
    dyn = LossCriticalBatch(law, 2e9)
    seq = 1024
    strategies = [ParallelStrategy(dp, 8 // dp, 1, 1, b) for dp in (2, 4, 8)
                  for b in (8, 16, 32, 64, 128) if b % dp == 0]
    times = {s: float(rng.uniform(0.8, 1.2)) * (0.05 + 0.01 * s.global_batch_size / s.dp)
             for s in strategies}
    cost = {(a.layout, b.layout): float(rng.uniform(0, 0.05)) for a in strategies
            for b in strategies}

    def switch(a, b):
        if a == b:
            return 0.0
        return batch_switch if a.layout == b.layout else cost[(a.layout, b.layout)]

    bounds = list(np.cumsum([0.0, *rng.uniform(2e5, 2e6, 4)]))
    s0 = law.s0
    reach = dyn.advance(s0, 0.0, 32 * seq, bounds[-1])
    goals = [s0 + 0.3 * (reach - s0), s0 + 0.8 * (reach - s0)]
    dp = exact_bound(dyn, bounds, strategies, seq, times.__getitem__, switch, goals, s0)
    full = exact_bound(dyn, bounds, strategies, seq, times.__getitem__, switch, goals, s0,
                       prune=False)
    assert dp[1].switches >= 1
    for goal, got, unpruned in zip(goals, dp, full, strict=True):
        brute = _brute_force(dyn, bounds, strategies, seq, times.__getitem__, switch, goal, s0)
        assert math.isfinite(brute) and got.time == pytest.approx(brute, rel=1e-9)
        assert unpruned.time == got.time and unpruned.path == got.path


@pytest.mark.parametrize("strategy", [ParallelStrategy(4, 1, 1, 2, 64),
                                      ParallelStrategy(1, 4, 1, 2, 16),
                                      ParallelStrategy(1, 2, 2, 2, 16)])
def test_probe_readings_are_unbiased_for_b_noise(strategy):
    """Averaged over many iterations the unbiased estimators give |G|^2 = 1 and tr(S) =
    B_noise, whatever replicas or micro-batches carry the small batch."""
    probe = SimulatedProbe(np.random.default_rng(0), 200)
    noise = 37.0
    g2, tr = [], []
    for _ in range(20000):
        stats = probe.read(strategy, noise)
        assert isinstance(stats, GradStats)
        sample = stats.sample()
        a, b = unbiased_estimates(sum(sample.small_sq) / len(sample.small_sq), sample.big_sq,
                                  sample.small_batch, sample.big_batch)
        g2.append(a)
        tr.append(b)
    for values, want in ((g2, 1.0), (tr, noise)):
        mean, se = np.mean(values), np.std(values) / math.sqrt(len(values))
        assert abs(mean - want) < 5 * se


def test_probe_reads_nothing_where_the_runtime_measures_nothing():
    probe = SimulatedProbe(np.random.default_rng(0), 100)
    assert probe.read(ParallelStrategy(1, 4, 1, 4, 4), 10.0) is None  # one micro-batch
    assert probe.read(ParallelStrategy(1, 2, 2, 4, 4), 10.0) is None  # and PP > 1
    # PP > 1 with >= 2 micro-batches reads the first micro-batch, as the runtime's stages do
    stats = probe.read(ParallelStrategy(1, 2, 2, 1, 8), 10.0)
    assert stats.first_microbatch_sq_norm is not None and stats.sample().small_batch == 1
    with pytest.raises(ValueError, match="noise_scale=nan"):
        probe.read(ParallelStrategy(2, 2, 1, 1, 4), math.nan)


def test_schedules():
    # Megatron: start 16, +16 every (ramp samples / 3) samples to 64
    seq = 1000
    assert [rampup_batch(t, seq, 16, 64, 3e6) for t in (0, 0.99e6, 1e6, 2.5e6, 3e6)] == \
        [16, 16, 32, 48, 64]
    # Seesaw: cosine halves at 1/2, quarters at 2/3 of the budget
    assert [seesaw_batch(x * 100, 8, 100, 1024) for x in (0.0, 0.49, 0.51, 0.68, 1.0)] == \
        [8, 8, 16, 32, 1024]


class _Times:
    """A tiny measured-time table for a 4-GPU clock."""

    def __init__(self, model, table):
        self.model, self.gpus, self.table = model, 4, table

    def lookup(self, s):
        return self.table.get(s)

    def line(self, s):
        return None


def _small_case():
    from megatron_cona.lawsim.cases import FAMILIES, SimCase, boundaries, dynamics_for, targets
    from megatron_cona.lawsim.clock import SimulatedClock
    from megatron_cona.policy import PolicyConfig
    from predictors.spec import TransformerSpec

    model = TransformerSpec("gpt", 2, 64, 4, 256, 512)
    cands = [ParallelStrategy(dp, 4 // dp, 1, 1, b) for dp in (2, 4) for b in (8, 16, 32, 64)]
    table = {s: 0.05 * (1 + s.global_batch_size / (8 * s.dp)) * (1.1 if s.tp > 1 else 1.0)
             for s in cands}
    clock = SimulatedClock(_Times(model, table), 0.3, 0.01, 1e9)
    law = ModelLaw("kaplan", 2e7, value("B_star"))
    params = 2e7
    dyn = dynamics_for("kaplan", law, 16 * 256, params)
    return SimCase("small/4gpu/kaplan", FAMILIES["gpt3-1.3b"], 4, "kaplan", law, dyn, clock,
                   "test clock", cands, table.__getitem__, 16,
                   boundaries(16 * 64 * 256, 0.1, 4 * 20 * params),
                   targets(dyn, law, 16 * 256, params), PolicyConfig(0.01, 20, 1, 0))


def _reachable(root, seen=None):
    """Every object reachable from ``root`` through attributes and containers."""
    seen = set() if seen is None else seen
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None))):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())


def test_cona_sees_readings_and_clock_never_the_law(monkeypatch):
    """What reaches CONA's session (its arguments and everything its objects hold) contains
    no law object (B_crit, the loss state): only GradStats, seconds and the clock."""
    from megatron_cona.lawsim import chains
    from megatron_cona.lawsim.law import CriticalBatch
    from megatron_cona.session import ConaSession

    case = _small_case()
    received = []
    real_observe = ConaSession.observe

    def spy(self, seconds, stats=None, iterations=1.0, loss=None):
        received.append((seconds, stats, iterations, loss))
        return real_observe(self, seconds, stats, iterations, loss)

    monkeypatch.setattr(ConaSession, "observe", spy)
    sessions = []
    real_make = chains.cona_session
    monkeypatch.setattr(chains, "cona_session",
                        lambda *a, **k: sessions.append(real_make(*a, **k)) or sessions[-1])
    result = chains.run_cona(case)[0]
    assert received and sessions and result.hits  # it ran, read the probe, reached targets
    assert all(isinstance(st, (GradStats, type(None))) and isinstance(sec, float)
               and isinstance(loss, float) for sec, st, _, loss in received)
    leaked = [o for o in _reachable(sessions[0]) if isinstance(o, (CriticalBatch, ModelLaw))]
    assert leaked == []
    # the readings carry the noise scale only through the norms a probe reports
    assert {f for f in vars(received[-1][1])} == set(GradStats.__dataclass_fields__)


def test_no_chain_beats_the_bound_and_a_cheat_is_caught(monkeypatch):
    from dataclasses import replace

    from megatron_cona.lawsim import chains
    from megatron_cona.lawsim.evaluate import ratios, run_case, summarize, worst_line

    case = replace(_small_case(), exact_bound=True, bound_snap=0.0)
    result = run_case(case)
    assert result["violations"] == []
    for target in case.goals:
        bound = result["chains"]["bound"][target]
        # the exact DP (cadence, switch costs) is a bound no chain beats, above the relaxation
        assert bound["exact_s"] >= bound["relaxed_s"] * (1 - 1e-9)
        assert bound["time_s"] == max(bound["exact_s"], bound["relaxed_s"])
        assert all(per[target]["time_s"] >= bound["exact_s"] * (1 - 1e-9)
                   for name, per in result["chains"].items()
                   if name != "bound" and chains.CHAINS[name].in_bound_space)
        r = ratios(result, target)
        assert r["gap_to_exact_bound"] <= r["gap_to_relaxed_bound"] + 1e-9
        assert r["gap_to_exact_bound"] >= 0 and r["ref_vs_best_static"] > 0
        oracle = result["chains"]["oracle"][target]["time_s"]
        assert r["ref_gap_to_exact_bound"] == pytest.approx(
            100.0 * (oracle / bound["exact_s"] - 1)) and r["ref_gap_to_exact_bound"] >= -1e-7
    ref = summarize([result], result["variant"])[result["gpus"]]["ref_gap_to_exact_bound"]
    # a gap's worst case is its largest
    assert ref["worst"] == max(ratios(result, t)["ref_gap_to_exact_bound"] for t in case.goals)
    assert f"ref_gap_to_exact_bound={ref['median']:.2f}%" in worst_line(
        summarize([result], result["variant"]), result["gpus"], result["variant"])

    def cheat(c):
        return [chains.SimResult("cheat", {}, hits={t: 1e-9 for t in c.goals})]

    monkeypatch.setitem(chains.CHAINS, "cheat", chains.Chain("cheat", cheat, "k"))
    assert any(v.startswith("cheat @") for v in run_case(case)["violations"])


def test_receive_side_switch_bytes_match_the_planner_where_both_run():
    """Beyond 64 GPUs the clock charges the bytes the busiest rank must receive; on 8 GPUs,
    where the full reshard plan is built, that never exceeds the plan's busiest rank and stays
    within 10% of it (the gap: a few replicas sending to many, e.g. dp2tp2pp2 -> dp8)."""
    from megatron_cona.lawsim.clock import GPT_1_3B, SimulatedClock, VTrainTimes

    clock = SimulatedClock(VTrainTimes(GPT_1_3B, 8), 0.5, 0.01, 300e9)
    layouts = [(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2)]
    for old, new in itertools.permutations(layouts, 2):
        planned, received = clock.moved_bytes(old, new), clock._received_bytes(old, new)
        assert received <= planned
        assert received >= 0.9 * planned, (old, new)


def test_oracle_starts_where_the_first_interval_progresses_fastest():
    """The per-interval-best reference starts on the strategy with the most progress per second
    over the first interval: no static strategy's first interval gains more S_min a second.
    (It once ranked the S reached, not the S gained, i.e. by throughput, and started on a
    large batch where B_crit was tiny.)"""
    from megatron_cona.lawsim import chains

    case = _small_case()
    s0 = case.law.s0

    def first_rate(result):
        p = result.points[1]
        return (case.law.s_min(p.loss / case.law.loss_scale) - s0) / p.time

    oracle = chains.run_oracle(case)[0]
    statics = chains.run_static(case)
    best = max(statics, key=first_rate)
    assert oracle.points[0].strategy == best.points[0].strategy
    assert first_rate(oracle) >= max(first_rate(r) for r in statics) * (1 - 1e-9)


@pytest.mark.parametrize(
    "field, value",
    [("micro_batches", (0,)), ("pipeline", (0, 1)), ("families", ()), ("variants", ()),
     ("min_gain", float("nan")), ("min_gain", -1.0), ("noise_z", float("nan")),
     ("noise_z", float("inf")), ("bound_snap", -0.1), ("bound_snap", float("nan")),
     ("bound_snap", 10.0), ("bound_snap", 1e-4), ("bound_snap", 1e-320),
     ("bound_snap", float("inf")),
     ("first_interval_iterations", 0), ("seed", -1), ("gpus", (8, 8)),
     ("families", ("bert-large", "bert-large")), ("variants", ("kaplan", "kaplan")),
     ("skip", ("seesaw", "seesaw")), ("exact_variants", ("kaplan", "kaplan")),
     ("gpus", (8, 10**30))],
)
def test_sim_options_name_the_field_that_cannot_run(field, value):
    """``cona scale`` took each: a 0 micro-batch or stage count, no family or variant (an empty
    report), a NaN gain or z, a negative snap, no first interval, a seed numpy refuses later,
    a repeated GPU count, family or variant (its cases run and counted twice); a snap of 10 or
    1e-320 (a rounded S past every goal: an infinite bound) or 1e-4 (the DP 0.3% below the
    relaxation), each then reported after the first case as "a chain beat the exact bound (a
    bug)"."""
    from megatron_cona.lawsim.evaluate import SimOptions

    with pytest.raises(LawError, match=f"^{field}"):
        SimOptions(**{field: value})


def test_the_largest_bound_snap_keeps_the_exact_dp_a_bound():
    """At the largest step SimOptions takes the rounded DP stays within what run_case tolerates
    below the relaxation; ten times it does not (so the limit is where the check bites)."""
    from dataclasses import replace

    from megatron_cona.lawsim.evaluate import BOUND_SNAP, SimOptions, run_case

    assert SimOptions(bound_snap=BOUND_SNAP[1]).bound_snap == BOUND_SNAP[1]
    for snap, violated in ((BOUND_SNAP[1], False), (10 * BOUND_SNAP[1], True)):
        result = run_case(replace(_small_case(), exact_bound=True, bound_snap=snap))
        assert bool(result["violations"]) == violated, (snap, result["violations"])


@pytest.mark.parametrize("iterations, refused", [(2, False), (10**30, True)])
def test_a_first_decision_after_the_first_target_is_refused(iterations, refused):
    """--first-interval-iterations 1e30 ran every case with no decision before the end: CONA
    reported 0.91x the tuned static, as if it had lost."""
    from megatron_cona.lawsim.evaluate import SimOptions, World, build_case

    case = _small_case()
    world = World(case.clock, "test clock", case.candidates, case.predicted, case.paper_batch,
                  0, 0.0)
    opts = SimOptions(first_interval_iterations=iterations)
    if not refused:
        assert len(build_case(opts, "gpt3-1.3b", 4, "kaplan", world).boundaries) > 2
        return
    with pytest.raises(LawError, match=r"^first_interval_iterations=10+: the first decision .* "
                       "comes after gpt3-1.3b's first target"):
        build_case(opts, "gpt3-1.3b", 4, "kaplan", world)


def test_cli_scale_with_an_empty_out_names_the_flag(tmp_path, monkeypatch, capsys):
    """--out '' wrote sim.json and a plot per case into the current folder without a word."""
    from megatron_cona.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["scale", "--switch-costs", "0,0", "--families", "bert-large", "--gpus", "8",
              "--variants", "kaplan", "--exact-variants", "", "--jobs", "1", "--out", ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].startswith("cona scale: error: argument --out: empty")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value, says", [
    ("8,8", "LawError: gpus=(8, 8) lists a value twice"),
    ("0", "LawError: gpus=(0,) must list integers >= 1"),
    ("eight", "argument --gpus: 'eight' is not a comma-separated list of integers"),
])
def test_cli_scale_refuses_a_bad_gpu_list_before_any_case_runs(value, says, tmp_path, capsys):
    """cona scale's integer lists are checked once, by SimOptions (which the benchmarks build
    directly too): a repeat ran its cases twice."""
    from megatron_cona.cli import main

    argv = ["scale", "--switch-costs", "0,0", "--families", "bert-large", "--gpus", value,
            "--variants", "kaplan", "--jobs", "1", "--out", str(tmp_path)]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"cona scale: error: {says}"
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("costs", ["0,3600", "0,1e30"])
def test_cli_scale_with_a_batch_switch_far_dearer_than_a_layout_switch_returns(costs, tmp_path):
    """The smallest case that hung: BERT-large on 8 GPUs. Its exact DP took over 100 s at
    0,3600 (fronts past 600,000 states: the greedy cap was 11% above the optimum) and never
    returned at 0,1e30; now seconds. Its path changes the batch only with the layout (a layout
    switch costs milliseconds here: 16 -> 32 sequences on dp8 by way of dp4 pp2), within 1%
    above the relaxation."""
    import json

    from megatron_cona.cli import main

    assert main(["scale", "--switch-costs", costs, "--families", "bert-large", "--gpus", "8",
                 "--variants", "kaplan", "--skip", "planner,rampup,seesaw,pollux", "--jobs", "1",
                 "--out", str(tmp_path)]) == 0
    (case,) = json.loads((tmp_path / "sim.json").read_text())["cases"]
    for result in case["chains"]["bound"].values():
        settings = result["settings"]
        assert settings["relaxed_s"] <= settings["exact_s"] < 1.01 * settings["relaxed_s"]
        layouts = [name.split("mb")[0] for name in result["path"]]  # dp8tp1pp1mb2gb16: dp8tp1pp1
        assert result["switches"] >= 1
        assert all(a != b for a, b in zip(layouts, layouts[1:], strict=False))


@pytest.mark.parametrize("costs", ["nan,0", "0,inf", "-1,0", "0,1e308", "a,b", "0", "0,1,2"])
def test_cli_scale_refuses_switch_costs_no_run_can_take(costs, capsys):
    """Negative, nan, inf: no switch costs that; from 1e308 a chain's summed switches overflow
    to inf (a matplotlib OverflowError); a word that is no number said "invalid _switch_costs
    value". All one line naming the flag and the form (--families nosuch: were the costs
    taken, that refusal would come instead of a whole run)."""
    from megatron_cona.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["scale", f"--switch-costs={costs}", "--families", "nosuch"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2
    assert err == (f"cona scale: error: argument --switch-costs: {costs!r} is not FIXED,BATCH: "
                   "two seconds from 0 to 1e+30")


def test_cli_scale_with_a_bound_snap_out_of_range_is_one_named_line(capsys):
    from megatron_cona.cli import main

    assert main(["scale", "--switch-costs", "0,0", "--bound-snap", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("cona scale: error: LawError: bound_snap=10.0 ")


@pytest.mark.parametrize("skip, says", [(("plannr",), "'plannr' is no chain"),
                                        (("seesaw", "Pollux"), "'Pollux' is no chain"),
                                        (("bound",), "'bound' cannot be left out"),
                                        (("static",), "'static' cannot be left out")])
def test_sim_options_skip_names_the_chains_it_can_leave_out(skip, says):
    """``cona scale --skip plannr`` ran every chain without a word; ``--skip bound`` (or static,
    oracle, cona: what the results are measured against) ran every case, then raised KeyError."""
    from megatron_cona.lawsim.evaluate import SimOptions

    with pytest.raises(LawError, match=f"^skip: {says}") as err:
        SimOptions(skip=skip)
    assert "planner, rampup, seesaw, pollux" in str(err.value)


def test_sim_options_skip_takes_the_benchmarks_rivals_pollux_registered_or_not():
    """cona_grid and bench_cona_scale leave out these four; Pollux is registered only by
    benchmarks/cona_pollux.py (where adaptdl is installed), so its name is known without it."""
    from megatron_cona.lawsim.chains import CHAINS
    from megatron_cona.lawsim.evaluate import SimOptions

    assert "pollux" not in CHAINS or CHAINS["pollux"].rival
    assert SimOptions(skip=("planner", "rampup", "seesaw", "pollux")).skip[-1] == "pollux"


def test_cli_scale_with_an_unknown_skip_is_one_named_line(capsys):
    from megatron_cona.cli import main

    assert main(["scale", "--switch-costs", "0,0", "--skip", "plannr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("cona scale: error: LawError: skip: 'plannr'")
