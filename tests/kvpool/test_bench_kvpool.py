"""benchmarks/bench_kvpool.py's systems run on a tiny prefix and return byte-identical KV, so a
broken baseline fails CI (its timings are the benchmark's business, not asserted here)."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_benchmark

pytest.importorskip("vllm_kvpool._kvio")


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("bench_kvpool")
    return module


def tiny(bench):
    return bench.Geometry(layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16,
                          tokens=1024, chunk_tokens=256)  # fmt: skip


@pytest.mark.parametrize("placement", ["bandwidth", "single_tier_serial", "round_robin"])
def test_pool_parts_fetch_identical_kv(bench, tmp_path, placement):
    """Every part a pool child measures really runs on the stored chunks: the fetch, the same
    with host verification, each device's share alone (only its bytes) and the serial fetch."""
    g = tiny(bench)
    s = bench.slot(g)
    devices = [{"host": {"capacity": 2 * s}},
               {"ssd": {"path": str(tmp_path / "ssd0.kvpool"), "backend": "uring",
                        "capacity": 5 * s}}]  # fmt: skip
    spec = {"system": "pool", "scenario": "smoke", "salt": "smoke", "reps": 2, "threads": 2,
            "config": bench.pool_config(g, devices, placement), "gbps": [8.0, 2.0]}  # fmt: skip
    results = bench.run_pool(g, spec)
    by = {}
    for r in results:
        by.setdefault(r.system, []).append(r)
    assert sorted(by) == ["alone:host0", "alone:ssd0", "pool", "pool-verify", "serial",
                          "together"]  # fmt: skip
    assert all(len(rs) == 2 and all(r.identical and r.seconds > 0 for r in rs)
               for rs in by.values())  # fmt: skip
    whole = {"host0": 2 * g.chunk_bytes, "ssd0": (g.num_chunks - 2) * g.chunk_bytes}
    for name in ("pool", "pool-verify", "together", "serial"):
        assert by[name][0].device_bytes == whole  # host full, the rest from the SSD
    assert by["alone:host0"][0].device_bytes == {"host0": whole["host0"]}
    assert by["alone:ssd0"][0].device_bytes == {"ssd0": whole["ssd0"]}
    assert [r.system for r in results[:6]] == [r.system for r in results[6:]][::-1]  # alternating


def test_lmcache_path_fetches_identical_kv(bench, tmp_path):
    """LMCache stores once and retrieves per repetition; a retrieve promotes its disk chunks into
    its CPU tier, so the matched split is restored before the next one (same bytes per tier)."""
    reason = bench.lmcache_available()
    if reason is not None:
        pytest.skip(reason)
    g = tiny(bench)
    gib = (g.num_chunks + 4) * g.chunk_bytes / 2**30
    spec = {"system": "lmcache-slice-odirect", "scenario": "smoke", "salt": "smoke",
            "copy": "slice", "odirect": True, "disk_dir": str(tmp_path / "lmc"), "disk_gib": gib,
            "cpu_gib": gib, "resident": 2, "reps": 2, "threads": 2}  # fmt: skip
    import torch

    torch.set_num_threads(2)  # as child_main does from spec["threads"]
    results = bench.run_lmcache(g, spec)
    assert [r.rep for r in results] == [0, 1]
    for r in results:
        assert r.identical and r.threads == 2
        assert r.device_bytes == {"lmcache-cpu": 2 * g.chunk_bytes,
                                  "lmcache-disk": (g.num_chunks - 2) * g.chunk_bytes}  # fmt: skip
    # buffered reads, then another thread count, on the same engine and stored files
    spec["extra"] = [{"system": "lmcache-slice-buffered", "odirect": False},
                     {"threads": 1, "scenario": "smoke-t1"}]  # fmt: skip
    results = bench.run_lmcache(g, spec)
    assert [(r.system, r.scenario, r.rep, r.threads) for r in results] == [
        ("lmcache-slice-odirect", "smoke", 0, 2), ("lmcache-slice-odirect", "smoke", 1, 2),
        ("lmcache-slice-buffered", "smoke", 0, 2), ("lmcache-slice-buffered", "smoke", 1, 2),
        ("lmcache-slice-odirect", "smoke-t1", 0, 1), ("lmcache-slice-odirect", "smoke-t1", 1, 1)]
    assert all(r.identical for r in results)


def test_summary_line_from_in_run_parts(bench):
    """frac_of_bound pairs each repetition's pool fetch with the slowest share alone of the same
    repetition; ratio_vs_serial is the serial fetch over the pool's."""
    g = tiny(bench)

    def r(system, seconds, rep):
        return bench.Result(system, "S1", seconds, g.prefix_bytes, 0.1, True, rep=rep)

    results = {"S1/pool": [r("pool", 1.0, 0), r("pool", 2.0, 1)],
               "S1/alone:host0": [r("alone:host0", 0.9, 0), r("alone:host0", 1.0, 1)],
               "S1/alone:ssd0": [r("alone:ssd0", 0.5, 0), r("alone:ssd0", 1.6, 1)],
               "S1/serial": [r("serial", 1.4, 0), r("serial", 2.6, 1)]}  # fmt: skip
    # The bound: max over devices of each share's fastest repetition (host0 0.9, ssd0 0.5),
    # never a single noisy sample of a part (ssd0's 1.6 in rep 1).
    assert bench.bound_fracs(results, "S1") == pytest.approx([0.9, 0.45])
    # The shares together without the pool's planning: the bound where slower than alone.
    together = {"S1/together": [r("together", 0.95, 0), r("together", 1.5, 1)]}
    assert bench.bound_fracs({**results, **together}, "S1") == pytest.approx([0.95, 0.475])
    assert bench.alone_fracs({**results, **together}, "S1") == pytest.approx([0.9, 0.45])
    # Placement runs: each step holds another prefix, so the minima are per step.
    steps = {"P/pool": [r("pool", 1.0, 0), r("pool", 2.0, 1)],
             "P/alone:ssd0": [r("alone:ssd0", t, rep) for rep, t in ((0, 0.9), (0, 0.8),
                                                                     (1, 1.9), (1, 1.7))],
             "P/together": [r("together", t, rep) for rep, t in ((0, 0.95), (0, 0.7),
                                                                 (1, 1.8), (1, 2.2))]}  # fmt: skip
    assert bench.bound_fracs(steps, "P", per_step=True) == pytest.approx([0.8, 0.9])
    args = type("A", (), {"out": None})()
    line = bench.summarize(g, results, args, lambda *_: None)
    f = (0.9 / 1.0 + 0.9 / 2.0) / 2  # the median of the two repetitions' fractions
    assert line.startswith(f"ratio_vs_lmcache=nan frac_of_bound={f:.2f} ratio_vs_serial=1.33 ")
    cpu = 0.1 / (g.prefix_bytes / 1e9)
    assert (f"multi_frac_of_bound=nan cpu_s_per_gb={cpu:.2f} lmcache_threads=0 pool_threads=1 "
            in line)  # fmt: skip
    # S1 per copy-thread count: here only the one thread the results ran with
    assert line.endswith(f"ratio_vs_lmcache_1t=nan frac_of_bound_1t={f:.2f} ratio_vs_lmcache_nt=nan "
                         "frac_of_bound_nt=nan n_threads=1 ratio_vs_rr_multi=nan "
                         "slowdown_recovery_fetches=none ratio_vs_rr_s4=nan")  # no placement


def test_children_run_with_the_pools_copy_threads(bench, tmp_path):
    """A child process gets ``spec["threads"]`` torch and OpenMP threads (LMCache's children go
    through the same ``run_child`` / ``child_main``), and the pool's timing window is the whole
    fetch call."""
    g = tiny(bench)
    s = bench.slot(g)
    devices = [{"host": {"capacity": 5 * s}}]
    spec = {"system": "pool", "scenario": "smoke", "salt": "threads", "reps": 1, "threads": 2,
            "parts": ["pool"], "workdir": str(tmp_path),
            "config": {**bench.pool_config(g, devices, "bandwidth"), "copy_threads": 2},
            "gbps": [8.0]}  # fmt: skip
    got = bench.run_child(g, spec, 300, lambda r: None)
    assert got and all(r.threads == 2 and r.identical for r in got)
    spec["threads"] = 1
    assert all(r.threads == 1 for r in bench.run_child(g, spec, 300, lambda r: None))
    # another thread count in the same child, on the chunks it stored (S1-t<k>): its own
    # scenario, its threads, the KV still fetched identical
    spec["extra"] = [{"threads": 2, "scenario": "smoke-t2", "parts": ["pool", "alone:*"]}]
    got = bench.run_child(g, spec, 300, lambda r: None)
    assert {(r.scenario, r.system, r.threads) for r in got} == {
        ("smoke", "pool", 1), ("smoke-t2", "pool", 2), ("smoke-t2", "alone:host0", 2)}
    assert all(r.identical for r in got)
    # each child's wall time is in the results file, with its parts, as soon as it exits
    walls = [json.loads(ln) for ln in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(walls) == 3 and all(w["record"] == "child" and w["wall_s"] > 0 for w in walls)
    assert {"start", "make_kv", "store", "measure"} <= set(walls[-1]["phases"])


def test_placement_run_saves_a_new_prefix_per_step_and_fetches_it_identical(bench, tmp_path):
    """S3p/S4's child: one pool per policy over the SAME devices, stepped in turn; per step a
    new prefix placed by the pool's current weights, fetched as the pool, then each SSD's share
    alone and together (twice each; the host pools' shares, never the slowest part, are not
    measured), every whole fetch byte-identical (the pools never read each other's chunks); the adaptive pool's weights move from the prior to what its own
    reads measured, round robin's split stays even."""
    g = tiny(bench)
    s = bench.slot(g)
    devices = [{"host": {"capacity": 1 * s}},
               {"ssd": {"path": str(tmp_path / "a.kvpool"), "backend": "uring", "capacity": 6 * s}},
               {"ssd": {"path": str(tmp_path / "b.kvpool"), "backend": "uring", "capacity": 6 * s}}]
    config = {**bench.pool_config(g, devices, "bandwidth"), "copy_threads": 1,
              "probe": {"learn_after": 1, "half_life": "1MiB"}}  # fmt: skip
    rr = {**config, "placement": "round_robin"}
    # two scenarios in turn on the same pools (S3p then S4): each from its own prior
    runs = [{"scenario": "S3p", "gbps": [1.0, 50.0, 100.0], "throttle_mbps": [1500]},
            {"scenario": "S4", "gbps": [50.0, 1.0, 100.0], "throttle_mbps": [1500, 500, 1500]}]
    spec = {"system": "placement", "scenario": "S3p+S4", "runs": runs, "threads": 1,
            "policies": [{"policy": "rr", "config": rr}, {"policy": "adaptive", "config": config}],
            "throttle": None}  # fmt: skip
    both = bench.run_placement(g, spec)
    assert {r.scenario for r in both} == {"S3p:adaptive", "S3p:rr", "S4:adaptive", "S4:rr"}
    first = next(r for r in both if r.system == "pool" and r.scenario == "S3p:adaptive")
    assert bench.json.loads(first.note)["weights"] == [1.0, 50.0, 100.0]
    results = [r for r in both if r.scenario.startswith("S4:")]
    for sc in ("S4:adaptive", "S4:rr"):
        for step in (0, 1, 2):
            parts = [r for r in results if r.rep == step and r.scenario == sc]
            names = [r.system for r in parts]
            assert names[0] == "pool" and names.count("together") == bench.BOUND_REPS
            assert all(names.count(n) == bench.BOUND_REPS for n in names if n.startswith("alone:"))
            assert "alone:host0" not in names and any(n.startswith("alone:ssd") for n in names)
            assert all(r.identical for r in parts)
            assert sum(parts[0].device_bytes.values()) == g.prefix_bytes
    # the policies take turns, the order rotating per step
    firsts = [next(r.scenario for r in results if r.rep == step) for step in (0, 1)]
    assert firsts == ["S4:rr", "S4:adaptive"]
    weights = [bench.json.loads(r.note)["weights"] for r in results
               if r.system == "pool" and r.scenario == "S4:adaptive"]  # fmt: skip
    assert weights[0] == [50.0, 1.0, 100.0] and weights[1] != weights[0]  # learned in service
    # (S4's first step placed by S4's prior: nothing S3p's steps taught the pool carried over)
    # each pool fetch's record carries the guard's state after it: the champion measured, one
    # time per device (the host pool's share included); the bound's parts carry none
    guards = [bench.json.loads(r.note)["guard"] for r in results
              if r.system == "pool" and r.scenario == "S4:adaptive"]  # fmt: skip
    assert all(gs["champion_s_per_gib"] > 0 and len(gs["devices_s_per_gib"]) == 3
               and 0 <= gs["band"] <= 0.25 and gs["before"] >= 0 for gs in guards)  # fmt: skip
    assert all(r.note and "guard" not in bench.json.loads(r.note)
               for r in results if r.system != "pool")  # fmt: skip
    ssd = [r.device_bytes for r in results if r.system == "pool" and r.scenario == "S4:rr"]
    assert all(b == ssd[0] for b in ssd)  # round robin's split ignores what was measured


def test_placement_summary_counts_the_slowed_fetches_before_the_placement_moved(bench):
    g = tiny(bench)

    def r(system, step, mbps, second_mib, seconds=1.0):
        return bench.Result(system, "S4:adaptive", seconds, g.prefix_bytes, 0.1, True,
                            {"ssd1": second_mib * 2**20}, rep=step,
                            note=bench.json.dumps({"throttle_mbps": mbps}))  # fmt: skip

    schedule = [(1500, 64), (1500, 64), (500, 64), (500, 64), (500, 48), (500, 16), (1500, 16)]
    results = {"S4:adaptive/pool": [r("pool", i, m, b) for i, (m, b) in enumerate(schedule)],
               "S4:adaptive/alone:ssd1": [r("alone:ssd1", i, m, b, 0.9)
                                          for i, (m, b) in enumerate(schedule)]}  # fmt: skip
    ratio, f, recovery, r_s4 = bench.placement_summary(results, lambda *_: None)
    assert recovery == "2"  # two slowed fetches (steps 2, 3) before step 4's save gave it less
    assert ratio != ratio and f != f and r_s4 != r_s4  # no S3p runs, no round robin: nan
    # S4 per phase, and round robin / adaptive over the whole run (summed fetch seconds)
    rr = [bench.Result("pool", "S4:rr", 1.5 if m == 500 else 1.0, g.prefix_bytes, 0.1, True,
                       {"ssd1": 64 * 2**20}, rep=i, note=bench.json.dumps({"throttle_mbps": m}))
          for i, (m, _) in enumerate(schedule)]  # fmt: skip
    lines: list[str] = []
    *_, r_s4 = bench.placement_summary({**results, "S4:rr/pool": rr}, lines.append)
    assert r_s4 == pytest.approx((3 * 1.0 + 4 * 1.5) / 7)  # 3 fetches at full speed, 4 slowed
    phases = [ln.split()[1] for ln in lines if ln.startswith("S4 ") and "rr / adaptive" in ln
              and "after its first step" not in ln]  # fmt: skip
    assert phases == ["before", "slowed", "recovered", "whole"]
    # the before phase judged again without its first (blind: the prior's) step
    assert any(ln.startswith("S4 before, after its first step (steps 1-1)") for ln in lines)
    # Two more recovered steps: the recovered phase after its first (blind) step, apart.
    more = [(1500, 16), (1500, 64)]
    ad = results["S4:adaptive/pool"] + [r("pool", 7 + i, m, b, 0.5) for i, (m, b) in enumerate(more)]
    rr += [bench.Result("pool", "S4:rr", 1.0, g.prefix_bytes, 0.1, True, {"ssd1": 64 * 2**20},
                        rep=7 + i, note=bench.json.dumps({"throttle_mbps": m}))
           for i, (m, _) in enumerate(more)]  # fmt: skip
    lines.clear()
    bench.placement_summary({**results, "S4:adaptive/pool": ad, "S4:rr/pool": rr}, lines.append)
    after = [ln for ln in lines if ln.startswith("S4 recovered, after its first step")]
    assert len(after) == 1 and "(steps 7-8)" in after[0] and after[0].endswith("rr / adaptive 2.00")
